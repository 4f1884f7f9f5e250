"""Whose is a failed gradient check: the hardware's or the data's (the train loop, training.train,
calls `attribute` on every rank after a failed check, `rerun_check` after a step a restart re-ran).

With a pre-step snapshot the step is re-run at once (training.integrity.rerun). Without one (ZeRO
>= 1; DP >= 3 under `audit.snapshot: auto`) a statistical check (a local gradient norm far above
its own history or its DP peers') fails the attempt, the controller blames nobody and restarts it
from the checkpoint with the step and each named rank's local norm (`TrainHooks.rerun_spikes`):
the restart is the re-run. Steps are deterministic, so

- the same norms on the same ranks, to the bit, and the same batches on other devices give the
  same norms too (training.integrity.swap, run before the step): the data's; the step stands,
  training goes on;
- the same norms, but not on another device: a persistent fault of the named ranks' devices;
- different norms: the first attempt's values were corrupted, a transient fault of the named
  ranks' hardware at the time (the controller counts it against their nodes then).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from training.integrity import swap
from training.integrity.detectors import IntegrityError
from training.integrity.rerun import (
    STATISTICAL_KINDS,
    RerunnableTrainer,
    data_spike,
    rerun_attribution,
    shared_error,
)
from training.parallel.dist import gather_object

Seen = Mapping[int, Mapping[int, float]]  # step -> {rank: local gradient norm}, as the failed attempt saw


def local_norm(trainer: Any) -> float | None:
    """This rank's local gradient norm of the step just run (before the DP reduction)."""
    audits = getattr(trainer, "grad_audits", None)
    if audits:
        return math.sqrt(sum(a.local_norm**2 for a in audits))
    check = getattr(trainer, "local_check", None)
    return check.last if check is not None else None


def attribute(trainer: RerunnableTrainer, step: int, error: IntegrityError | None,
              seen: Seen | None) -> tuple[IntegrityError, bool]:
    """The error every rank agrees on after a failed check at `step`, attributed (re-run from the
    pre-step snapshot when there is one), and whether it is the data's gradient spike: reproduced by
    that re-run or, with no snapshot, by this restart of a step in `seen`."""
    shared, found = shared_error(error, local_norm(trainer))
    settled, trainer.settled = getattr(trainer, "settled", None), None
    if settled is not None and settled[0] == step and all(kind in STATISTICAL_KINDS for kind, *_ in found):
        return settled[1], settled[2]  # re-run before the update (training.integrity.before_update)
    snap = trainer.snapshot
    if snap is not None and snap.step == step:
        shared = rerun_attribution(trainer, step, shared, found)
        return shared, data_spike(shared, found)
    before = (seen or {}).get(step)
    now = {int(r): v for r, v in (shared.evidence.get("grad_norms_local") or {}).items()}
    if (before and all(kind in STATISTICAL_KINDS for kind, *_ in found)
            and now == {int(r): float(v) for r, v in before.items()}):
        evidence = {**shared.evidence, "local_reproduced": True, "attribution": "the restart re-ran it"}
        probed = getattr(trainer, "swapped", {}).get(step)
        if probed is not None:
            evidence["swap"] = swap.evidence(probed, sorted(now))
            if not evidence["swap"]["follows_data"]:  # the same device again, not the batch
                evidence.update(transient=False, reproduced=True, attribution="the restart re-ran it; the "
                                "batch on a DP peer's device gave another norm")
                named = swap.culprits(probed, sorted(now), trainer.cfg.layout)
                return IntegrityError(shared.kind, step, named, evidence), False
        return IntegrityError(shared.kind, step, shared.ranks, evidence), True
    return shared, False


def probe_rerun(trainer: Any, step: int, seen: Seen | None) -> None:
    """Before a step the restart re-runs (`seen`): its batches on other devices, for `attribute`
    (training.integrity.swap; every rank calls it)."""
    if step in (seen or {}) and swap.supported(trainer.cfg.layout):
        trainer.swapped = {step: swap.probe(trainer, step)}


def rerun_check(trainer: Any, before: Mapping[int, float]) -> tuple[list[int], list[int]]:
    """After a step the restart re-ran and no check failed in: the ranks of `before` whose local norm
    is the same to the bit (the data's, though the check's history did not flag it this time) and
    those whose norm changed (the first attempt's was corrupted). Every rank calls it."""
    norms = gather_object(local_norm(trainer))
    same = sorted(int(r) for r, v in before.items() if norms[int(r)] == float(v))
    return same, sorted(int(r) for r in before if int(r) not in same)
