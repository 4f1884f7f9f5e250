"""Attribution of a failed integrity check by re-running the step: every rank agrees on one error,
re-runs the step from the pre-step snapshot, and the ranks whose first result did not reproduce
(transient) or did (persistent) are named; two replicas that disagree again leave a snapshot for a
referee (training.integrity.referee). The train loop (training.train) calls it on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from training.config.run import RunConfig
from training.integrity import swap
from training.integrity.attribution import StepSnapshot, rerun_verdict
from training.integrity.detectors import IntegrityError, json_number
from training.integrity.fingerprint import FingerprintVote
from training.integrity.gradient import GRAD_CHECK_KINDS
from training.integrity.referee import referee_snapshot_path, referee_supported, save_referee_snapshot
from training.parallel.dist import DistContext, gather_object
from training.parallel.precision import masters_in_place


class RerunnableTrainer(Protocol):
    """What the re-run needs of the trainer (training.train.Trainer)."""

    ctx: DistContext
    cfg: RunConfig
    snapshot: StepSnapshot | None
    last_vote: FingerprintVote | None  # the vote of the step as first run (None when not due)
    pending_vote: FingerprintVote | None  # the vote of the step just run
    rerun_local: tuple[float, bool] | None  # the local gradient check's report on the re-run

    def train_step(self, step: int, rerun: bool = False) -> tuple[float, list[int]]: ...


def shared_error(error: IntegrityError | None,
                 norm: float | None = None) -> tuple[IntegrityError, list[tuple]]:
    """The integrity error every rank raises: the lowest-ranked detector's, with all detectors' ranks;
    and every detector's (kind, step, ranks, evidence). `norm`: this rank's local gradient norm;
    the evidence carries those of the ranks a statistical check named (`grad_norms_local`)."""
    # Sent as plain tuples: IntegrityError's constructor arguments do not survive pickling.
    mine = (error.kind, error.step, error.ranks, error.evidence) if error is not None else None
    gathered = gather_object((mine, norm))
    found = [e for e, _ in gathered if e is not None]
    kind, step, _, evidence = found[0]
    ranks = sorted({r for e in found for r in e[2]})
    named = {r for k, _, rs, _ in found if k in STATISTICAL_KINDS for r in rs}
    norms = {str(r): gathered[r][1] for r in sorted(named) if _finite(gathered[r][1])}
    if norms:  # for a restart with no snapshot to compare (training.integrity.settle)
        evidence = {**evidence, "grad_norms_local": norms}
    return IntegrityError(kind, step, ranks, evidence), found


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# The statistical gradient checks: a local norm far above its own history, or far above the DP
# peers' (one rank's micro-batch can be that odd): the data itself can produce both. Reproduced to
# the bit, on other devices too (training.integrity.swap), they are the data's; an exact check (the
# bucket checksum, ABFT) or a replica vote that reproduces is not. (workers.controller.classify
# keeps the same list.)
STATISTICAL_KINDS = ("grad_norm_spike", "grad_norm_outlier")


_LOCAL_KINDS = ("grad_norm_spike", "nonfinite", *GRAD_CHECK_KINDS)


def rerun_attribution(
    trainer: RerunnableTrainer, step: int, shared: IntegrityError, found: list[tuple],
    rerun: tuple[Callable[[], float | None], str] | None = None,
) -> IntegrityError:
    """Run `step` again from the pre-step snapshot on every rank and name the rank(s) whose first
    result did not reproduce (transient) or did (persistent). See training.integrity.attribution.
    `rerun`: (the re-run, its name) from parameters the step has not yet updated instead
    (training.integrity.before_update): no snapshot to restore, no replica vote to compare."""
    first = trainer.last_vote if rerun is None else None
    if rerun is None:
        with masters_in_place(trainer.optimizers):
            trainer.snapshot.restore()  # type: ignore[union-attr]
    spiked = _swap_ranks(found, dist.get_world_size())
    probed = swap.probe(trainer, step) if spiked and swap.supported(trainer.cfg.layout) else None
    rerun_loss = trainer.train_step(step, rerun=True)[0] if rerun is None else rerun[0]()
    rerun_vote = trainer.pending_vote if first is not None else None
    mine: dict[str, Any] = {"rank": trainer.ctx.rank}
    if first is not None and rerun_vote is not None and first.divergent:
        culprits, transient, evidence = rerun_verdict(first, rerun_vote)
        mine["vote"] = (culprits, transient, evidence)
    if trainer.rerun_local is not None:
        mine["local"] = trainer.rerun_local
    referee = _maybe_write_referee_snapshot(trainer, step, first, rerun_vote)
    results = gather_object(mine)  # also the barrier after which the referee's snapshot is on disk
    culprits: set[int] = set()
    transient: bool | None = True  # None: no re-run result spoke for the named ranks
    how = "rerun from the pre-step snapshot" if rerun is None else rerun[1]
    evidence: dict[str, Any] = {"attribution": how, "first": shared.evidence}
    votes = {}
    for res in results:
        if "vote" in res:
            c, t, ev = res["vote"]
            culprits.update(c)
            transient = transient and t
            votes[str(tuple(ev["ranks"]))] = ev
    if votes:
        evidence["votes"] = list(votes.values())
    local_named = sorted({r for kind, _, ranks, _ in found if kind in _LOCAL_KINDS for r in ranks})
    again: set[int] = set()  # the named ranks whose own check fired again on the re-run
    if local_named:
        again = {res["rank"] for res in results if res.get("local", (0.0, False))[1]}
        evidence["local_rerun"] = {str(res["rank"]): json_number(res.get("local", (None,))[0])
                                   for res in results}
        evidence["local_reproduced"] = set(local_named) <= again  # every named rank spiked again
        if len(local_named) < dist.get_world_size():
            culprits.update(local_named)
            transient = transient and not again & set(local_named)
    if probed is not None:  # the same batches on other devices (training.integrity.swap)
        evidence["swap"] = swap.evidence(probed, spiked)
        if evidence.get("local_reproduced") and not evidence["swap"]["follows_data"]:
            # reproduced on the same device only: that device's, every time (under PP: the stage
            # where the pipelines part, which need not be the one that spiked)
            named = swap.culprits(probed, spiked, trainer.cfg.layout)
            culprits.difference_update(set(spiked) - set(named))
            culprits.update(named)
            transient = False
            evidence["attribution"] += "; the batch on a DP peer's device gave another norm"
    if rerun_loss is not None:  # None: a re-run before the update (no step loss)
        evidence["rerun_loss"] = rerun_loss if math.isfinite(rerun_loss) else str(rerun_loss)
    diverged = None if rerun_loss is None else diverged_again(shared, found, rerun_loss, results,
                                                               dist.get_world_size())
    if diverged is None and evidence.get("local_reproduced") and (evidence.get("swap") or {}).get(
            "follows_data") and _nonfinite_ranks(found):  # the batches' own: any device gives it
        diverged = {"what": "local gradient norm", "value": "nan or inf", "step": shared.step,
                    "ranks": _nonfinite_ranks(found), "on": "the rank's device and its DP peer's alike"}
    if diverged is not None:
        evidence["diverged"] = diverged
    if not culprits:  # nobody singled out: every rank the first check named stays named
        culprits = set(shared.ranks)
        if not votes:  # no vote said: what the named ranks' own re-run showed, else unknown
            transient = not again & set(local_named) if local_named else None
    if diverged is not None:  # the re-run diverged again: reproduced, whoever is named
        transient = False
    evidence["transient"] = transient
    evidence["reproduced"] = None if transient is None else not transient
    if referee is not None and transient is False:
        evidence["referee"] = referee  # the controller asks a spare on a healthy node (workers.referee)
    return IntegrityError(shared.kind, step, sorted(culprits), evidence)


def _nonfinite_ranks(found: list[tuple]) -> list[int]:
    """The ranks whose own local gradient was non-finite (a non-finite loss is the global mean's)."""
    return sorted({r for kind, _, ranks, ev in found if kind == "nonfinite" and "loss" not in (ev or {})
                   for r in ranks})


def _swap_ranks(found: list[tuple], world: int) -> list[int]:
    """The ranks whose reproduced result the swap probe places on the data or the device: those a
    statistical check named, and those with a non-finite local gradient when not every rank had one."""
    spiked = {r for kind, _, ranks, _ in found if kind in STATISTICAL_KINDS for r in ranks}
    nonfinite = set(_nonfinite_ranks(found))
    return sorted(spiked | (nonfinite if len(nonfinite) < world else set()))


def data_spike(error: IntegrityError, found: list[tuple]) -> bool:
    """Only the local gradient-norm check fired, and every rank it named spiked again on the re-run
    from the snapshot (the same on every rank: `error` is `rerun_attribution`'s agreed result)."""
    ev = error.evidence or {}
    return (bool(found) and all(kind in STATISTICAL_KINDS for kind, *_ in found)
            and ev.get("local_reproduced") is True and not ev.get("votes") and "diverged" not in ev
            and (ev.get("swap") or {}).get("follows_data", True))


def diverged_again(shared: IntegrityError, found: list[tuple], rerun_loss: float,
                   results: list[dict[str, Any]], world: int) -> dict[str, Any] | None:
    """A non-finite loss (the global mean, the same on every rank) or a non-finite local gradient
    norm on every rank, which the re-run from the snapshot reproduced: the training diverged, the
    same on every replica, so no rank's hardware is to blame (the job's own failure)."""
    if shared.kind != "nonfinite":
        return None
    if not math.isfinite(rerun_loss):
        return {"what": "loss", "value": str(rerun_loss), "step": shared.step}
    named = {r for kind, _, ranks, _ in found if kind == "nonfinite" for r in ranks}
    norms = [res["local"][0] for res in results if "local" in res]
    if len(named) == world and len(norms) == world and not any(math.isfinite(v) for v in norms):
        return {"what": "gradient norm", "value": str(norms[0]), "step": shared.step}
    return None


def _maybe_write_referee_snapshot(trainer: RerunnableTrainer, step: int, first: FingerprintVote | None,
                                  rerun: FingerprintVote | None) -> dict[str, Any] | None:
    """Two replicas that disagreed again on the re-run: the lowest rank writes the pre-step
    snapshot for a referee (training.integrity.referee) and every rank returns where it is."""
    cfg = trainer.cfg
    if (first is None or rerun is None or rerun.ok or not rerun.ambiguous or not cfg.checkpoint.dir
            or trainer.snapshot is None or not referee_supported(cfg.layout)):
        return None
    path = referee_snapshot_path(cfg.checkpoint.dir, step)
    if trainer.ctx.rank == min(first.ranks):
        save_referee_snapshot(path, trainer.snapshot.state())
    prints = {str(r): f"{f:032x}" for r, f in zip(first.ranks, first.fingerprints, strict=True)}
    return {"snapshot": path, "step": step, "dp_group": list(first.ranks), "fingerprints": prints}
