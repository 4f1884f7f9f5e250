"""A gradient spike the data itself produces is not corruption (the bench.recovery job's step 295:
a clean run's local gradient norm 16x its history quarantined both nodes and left the job waiting
for a node forever). The re-run from the pre-step snapshot reproduces it bit for bit on every rank:
the re-run step stands, the hooks hear of it, and training goes on to the fault-free run's weights.
Real train loop on 2 gloo ranks; a spike factor this low makes ordinary steps spikes."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)


def _worker(rank: int, world: int, audit: dict | None) -> dict:
    import torch

    from training.hooks import TrainHooks
    from training.integrity.attribution import AuditConfig
    from training.parallel.dist import DistContext
    from training.train import train

    spikes: list[tuple] = []

    class Hooks(TrainHooks):
        def on_gradient_spike(self, error) -> None:
            spikes.append((error.kind, error.step, tuple(error.ranks), error.evidence["local_reproduced"]))

    hooks = Hooks()
    if audit is not None:
        hooks.audit = AuditConfig(**audit)
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    result = train(ctx, RunConfig(model=SPEC, layout=Layout(dp=2), steps=12), hooks, resume=False)
    return {"digest": result.model_digest, "spikes": spikes, "final": result.final_step}


# Factors this low make ordinary steps trip the check: against the rank's own history, or (one rank
# always has the larger norm of two) against its DP peer's.
SPIKE = {"grad_spike_factor": 1.0001, "grad_warmup": 2}
OUTLIER = {"grad_norm_factor": 1.0001, "local_grad_check": False}


@pytest.mark.parametrize(("audit", "kind"), [(SPIKE, "grad_norm_spike"), (OUTLIER, "grad_norm_outlier")],
                         ids=["own-history", "peer-outlier"])
def test_a_reproduced_gradient_spike_is_the_datas_and_training_goes_on(audit, kind) -> None:
    spiky = run_ranks(2, _worker, (audit,))
    clean = run_ranks(2, _worker, (None,))
    assert clean[0]["spikes"] == [] and spiky[0]["spikes"], spiky[0]
    assert spiky[0]["spikes"] == spiky[1]["spikes"]  # agreed: every rank heard the same
    assert all(k == kind and reproduced for k, _, _, reproduced in spiky[0]["spikes"]), spiky[0]
    assert [r["final"] for r in spiky] == [12, 12]
    assert {r["digest"] for r in spiky} == {clean[0]["digest"]}  # the re-run steps are the real ones


def _attempt(rank: int, world: int, audit: dict, layout: dict, ckpt: str, seen: dict) -> dict:
    import torch

    from training.config.layout import Layout as L
    from training.config.run import CheckpointConfig
    from training.hooks import TrainHooks
    from training.integrity.attribution import AuditConfig
    from training.integrity.detectors import IntegrityError
    from training.parallel.dist import DistContext
    from training.train import train

    accepted: list[tuple] = []
    reruns: list[tuple] = []

    class Hooks(TrainHooks):
        def on_gradient_spike(self, error) -> None:
            accepted.append((error.step, error.evidence.get("attribution")))

        def on_gradient_rerun(self, step, same, changed) -> None:
            reruns.append((step, same, changed))

        def on_integrity_error(self, error):  # as the Ray ranks do: the attempt fails
            raise error

    hooks = Hooks()
    hooks.audit = AuditConfig(**audit)
    hooks.rerun_spikes = seen
    cfg = RunConfig(model=SPEC, layout=L(**layout), steps=STEPS[layout["dp"]],
                    checkpoint=CheckpointConfig(dir=ckpt, every_steps=CKPT_EVERY[layout["dp"]]))
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    try:
        result = train(ctx, cfg, hooks, resume=True)
    except IntegrityError as e:
        return {"failed": e.step, "norms": e.evidence.get("grad_norms_local"), "accepted": accepted}
    return {"digest": result.model_digest, "final": result.final_step, "accepted": accepted, "reruns": reruns}


def _clean(rank: int, world: int, layout: dict) -> str:
    import torch

    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    cfg = RunConfig(model=SPEC, layout=Layout(**layout), steps=STEPS[layout["dp"]])
    return train(ctx, cfg, resume=False).model_digest


STEPS = {2: 6, 3: 3}
CKPT_EVERY = {2: 3, 3: 1}


@pytest.mark.parametrize(("audit", "layout"), [(SPIKE, {"dp": 2, "zero_stage": 1}), (OUTLIER, {"dp": 3})],
                         ids=["own-history-zero1", "peer-outlier-dp3"])
def test_with_no_snapshot_the_restart_re_runs_a_spike_and_the_same_spike_is_the_datas(
        audit, layout, tmp_path) -> None:
    """No pre-step snapshot (ZeRO-1; DP 3 under `audit.snapshot: auto`): the spike fails the attempt
    (nobody is blamed; the controller restarts it from the checkpoint with the spike's norms); on the
    restart the same spike, to the bit, is the data's and the job goes on to the fault-free run's
    weights."""
    world = layout["dp"]
    seen: dict[int, dict[int, float]] = {}
    attempts = []
    for _ in range(8):
        out = run_ranks(world, _attempt, (audit, layout, str(tmp_path), dict(seen)))
        attempts.append(out[0])
        if "failed" not in out[0]:
            break
        assert len({o["failed"] for o in out}) == 1 and out[0]["norms"], out
        seen[out[0]["failed"]] = {int(r): v for r, v in out[0]["norms"].items()}
    assert attempts[-1].get("final") == STEPS[world], attempts
    restarted = [step for a in attempts for step, how in a["accepted"] if how == "the restart re-ran it"]
    assert restarted and set(restarted) <= set(seen), attempts
    assert attempts[-1]["digest"] == run_ranks(world, _clean, (layout,))[0]


def test_a_restart_whose_re_run_changes_the_norms_reports_a_transient_fault(tmp_path) -> None:
    """The re-run by the restart is compared even when no check fires this time (a fresh history):
    the first attempt's norms again to the bit are the data's; other norms mean the first attempt's
    were corrupt, and the ranks say which rank's changed (the controller blames its node then)."""
    layout = {"dp": 2, "zero_stage": 1}
    first = run_ranks(2, _attempt, (SPIKE, layout, str(tmp_path / "a"), {}))[0]
    step, norms = first["failed"], {int(r): v for r, v in first["norms"].items()}
    calm = {"grad_spike_factor": 1e6}  # the check never fires: only the re-run's comparison speaks
    same = run_ranks(2, _attempt, (calm, layout, str(tmp_path / "b"), {step: norms}))
    assert same[0]["reruns"] == same[1]["reruns"] == [(step, sorted(norms), [])]
    corrupt = {step: {r: v * 2 for r, v in norms.items()}}  # as a bit flip would have shown them
    changed = run_ranks(2, _attempt, (calm, layout, str(tmp_path / "c"), corrupt))
    assert changed[0]["reruns"] == changed[1]["reruns"] == [(step, [], sorted(norms))]
    assert changed[0]["digest"] == same[0]["digest"] == run_ranks(2, _clean, (layout,))[0]
