"""A gradient spike the data itself produces is not corruption (the bench.recovery job's step 295:
a clean run's local gradient norm 16x its history quarantined both nodes and left the job waiting
for a node forever). The re-run from the pre-step snapshot reproduces it bit for bit on every rank:
the re-run step stands, the hooks hear of it, and training goes on to the fault-free run's weights.
Real train loop on 2 gloo ranks; a spike factor this low makes ordinary steps spikes."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks, train_to_integrity_error
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec
from training.integrity import swap

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
            spikes.append((error.kind, error.step, tuple(error.ranks), error.evidence["local_reproduced"],
                           error.evidence["swap"]["follows_data"]))  # on the DP peer's device too

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
    assert all(k == kind and reproduced and follows for k, _, _, reproduced, follows in spiky[0]["spikes"])
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
            assert error.evidence["swap"]["follows_data"] is True  # the batch's, on the peer's device too

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


NO_SNAPSHOT = [(SPIKE, {"dp": 2, "zero_stage": 1}), (OUTLIER, {"dp": 3})]
NEVER = {"snapshot": "never"}  # no re-run in the step: the restart is the re-run


@pytest.mark.parametrize(("audit", "layout"), NO_SNAPSHOT, ids=["own-history-zero1", "peer-outlier-dp3"])
def test_with_no_snapshot_a_spike_is_re_run_before_the_update_and_no_attempt_fails(
        audit, layout, tmp_path) -> None:
    """No pre-step snapshot (ZeRO-1; DP 3 under `audit.snapshot: auto`): the check fires after the
    backward, before the optimizer step, so the step is re-run there from the parameters it started
    from (training.integrity.before_update). The same spikes on the same batches are the data's: no
    attempt fails, no step is lost, and the weights are the fault-free run's."""
    out = run_ranks(layout["dp"], _attempt, (audit, layout, str(tmp_path), {}))
    assert "failed" not in out[0] and out[0]["final"] == STEPS[layout["dp"]], out[0]
    accepted = out[0]["accepted"]
    assert accepted and {how for _, how in accepted} == {"re-run before the update"}, accepted
    assert all(o["accepted"] == accepted for o in out)  # agreed: every rank heard the same
    assert out[0]["digest"] == run_ranks(layout["dp"], _clean, (layout,))[0]


# The DP 3 peer-outlier variant is slow (`make test-slow`); it runs before the update above in `make test`.
@pytest.mark.parametrize(("audit", "layout"), [
    pytest.param(*NO_SNAPSHOT[0], id="own-history-zero1"),
    pytest.param(*NO_SNAPSHOT[1], id="peer-outlier-dp3", marks=pytest.mark.slow),
])
def test_with_re_runs_off_the_restart_re_runs_a_spike_and_the_same_spike_is_the_datas(
        audit, layout, tmp_path) -> None:
    """`audit.snapshot: never` and no snapshot: the spike fails the attempt (nobody is blamed; the
    controller restarts it from the checkpoint with the spike's norms); on the restart the same
    spike, to the bit, is the data's and the job goes on to the fault-free run's weights."""
    audit = {**audit, **NEVER}
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
    first = run_ranks(2, _attempt, ({**SPIKE, **NEVER}, layout, str(tmp_path / "a"), {}))[0]
    step, norms = first["failed"], {int(r): v for r, v in first["norms"].items()}
    calm = {"grad_spike_factor": 1e6}  # the check never fires: only the re-run's comparison speaks
    same = run_ranks(2, _attempt, (calm, layout, str(tmp_path / "b"), {step: norms}))
    assert same[0]["reruns"] == same[1]["reruns"] == [(step, sorted(norms), [])]
    corrupt = {step: {r: v * 2 for r, v in norms.items()}}  # as a bit flip would have shown them
    changed = run_ranks(2, _attempt, (calm, layout, str(tmp_path / "c"), corrupt))
    assert changed[0]["reruns"] == changed[1]["reruns"] == [(step, [], sorted(norms))]
    assert changed[0]["digest"] == same[0]["digest"] == run_ranks(2, _clean, (layout,))[0]


FAULT_STEP = 4


def _faulty_device(rank: int, world: int, layout: dict, ckpt: str, seen: dict, snapshot: str) -> dict:
    """A rank whose device scales one parameter's gradient by 1e4 every time it computes step
    FAULT_STEP (a persistent fault: re-runs and restarts on it reproduce the spike to the bit)."""

    from training.config.layout import Layout as L
    from training.config.run import CheckpointConfig
    from training.hooks import TrainHooks
    from training.integrity.attribution import AuditConfig
    from training.integrity.injection import BitFlipInjector

    class FaultyDevice(BitFlipInjector):
        def arm_grad_flips(self, step, named_params):  # called before every backward of a step
            for _, handle in self._armed:
                handle.remove()
            self._armed = []
            if step == FAULT_STEP and self.rank == 1:
                _, p = max(named_params, key=lambda item: item[1].numel())
                self._armed.append((None, p.register_hook(lambda g: g * 1e4)))
            return []

    accepted: list[int] = []

    class Hooks(TrainHooks):
        def on_gradient_spike(self, error) -> None:
            accepted.append(error.step)

    hooks = Hooks()
    hooks.audit = AuditConfig(snapshot=snapshot)
    hooks.injector = FaultyDevice([], rank)
    hooks.rerun_spikes = seen
    cfg = RunConfig(model=SPEC, layout=L(**layout), steps=6,
                    checkpoint=CheckpointConfig(dir=ckpt, every_steps=2))
    return train_to_integrity_error(rank, world, cfg, hooks, resume=True) | {"accepted": accepted}


@pytest.mark.parametrize(("layout", "snapshot"), [({"dp": 2}, "auto"), ({"dp": 2, "zero_stage": 1}, "auto"),
                                                ({"dp": 2, "zero_stage": 1}, "never")],
                         ids=["snapshot", "before-update", "restart"])
def test_a_spike_a_faulty_device_reproduces_is_the_devices_not_the_datas(layout, snapshot, tmp_path) -> None:
    """A persistent fault reproduces its spike on every re-run on the same device, as data would;
    its batch computed on the DP peer's device does not (training.integrity.swap): the rank is named,
    persistent, and the step does not stand. With a snapshot, or re-run before the update (ZeRO-1),
    the re-run says so at once; with re-runs off the restart re-runs the step (after the first
    failure blamed nobody) and says so then."""
    seen: dict[int, dict[int, float]] = {}
    out = run_ranks(2, _faulty_device, (layout, str(tmp_path), seen, snapshot))
    if snapshot == "never":  # no re-run: nobody blamed yet, the norms go to the restart
        assert "transient" not in out[0]["evidence"], out[0]
        seen = {out[0]["step"]: {int(r): v for r, v in out[0]["evidence"]["grad_norms_local"].items()}}
        out = run_ranks(2, _faulty_device, (layout, str(tmp_path), seen, snapshot))
    assert out[0] == out[1], out  # agreed on every rank
    failed = out[0]
    assert failed.get("step") == FAULT_STEP and failed["kind"] == "grad_norm_outlier", failed
    ev = failed["evidence"]
    assert failed["ranks"] == [1] and ev["transient"] is False and ev["local_reproduced"] is True, ev
    assert ev["swap"]["follows_data"] is False and FAULT_STEP not in failed["accepted"], ev
    own, peer = ev["swap"]["norms"]["1"]["own"], ev["swap"]["norms"]["1"]["peer"]
    assert own > 100 * peer  # rank 1's batch: spiked on its own device, ordinary on rank 0's


def _overflowing_batch(rank: int, world: int, ckpt: str) -> dict:
    """Rank 1's batch at step FAULT_STEP overflows its own gradient on any device (its loss is
    finite): the data's, as a pathological sample in low precision would be."""
    import torch

    from training.config.run import CheckpointConfig
    from training.data.sources import make_data_source
    from training.hooks import TrainHooks
    from training.integrity.detectors import IntegrityError
    from training.model.transformer import Transformer
    from training.parallel.dist import DistContext
    from training.train import train

    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=6,
                    checkpoint=CheckpointConfig(dir=ckpt, every_steps=2))
    bad = make_data_source(cfg.data, cfg.model, cfg.global_batch).batch(FAULT_STEP, 1, 2)[1]
    loss = Transformer.loss

    def overflowing(self, logits, targets):
        if logits.requires_grad and any(torch.equal(t, b) for t in targets for b in bad):
            logits.register_hook(lambda g: g * float("inf"))
        return loss(self, logits, targets)

    Transformer.loss = overflowing

    class Hooks(TrainHooks):
        def on_integrity_error(self, error):
            raise error

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    try:
        train(ctx, cfg, Hooks(), resume=False)
    except IntegrityError as e:
        return {"kind": e.kind, "step": e.step, "ranks": e.ranks, "evidence": e.evidence}
    return {}


def test_a_non_finite_gradient_one_rank_s_batch_gives_on_any_device_is_the_jobs(tmp_path) -> None:
    """One rank's local gradient is non-finite and the re-run reproduces it: the swap probe computes
    that batch on the DP peer's device, non-finite again, so the batch is at fault, not the device:
    the evidence says diverged (the controller fails the job and quarantines nothing)."""
    from workers.controller.attempt import Attempt
    from workers.controller.classify import FailureHistory, classify
    from workers.policies import Failure, FailureClass, FailureKind

    out = run_ranks(2, _overflowing_batch, (str(tmp_path),))
    assert [(o.get("step"), o.get("ranks")) for o in out] == [(FAULT_STEP, [1])] * 2, out
    ev = out[0]["evidence"]
    assert ev["swap"]["follows_data"] is True and ev["diverged"]["ranks"] == [1], ev
    failure = Failure(FailureKind.SDC, "nonfinite", tuple(out[0]["ranks"]), ("n1",), FAULT_STEP, evidence={
        "error_kind": out[0]["kind"], "step": FAULT_STEP, "evidence": ev})
    attempt = Attempt(rank_node={0: "n0", 1: "n1"})
    assert classify(failure, attempt, FailureHistory()).failure_class == FailureClass.JOB_ERROR


def _probed_run(rank: int, world: int, layout: dict, probe_at: int | None) -> dict:
    """Train 4 steps; with `probe_at`, the restart's swap probe runs before that step (as when a
    restart re-runs a spike there) and its result is kept."""
    import torch

    import training.integrity.settle as settle
    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import train

    results = []
    probe = settle.swap.probe
    settle.swap.probe = lambda trainer, step: results.append(probe(trainer, step)) or results[-1]
    hooks = TrainHooks()
    hooks.rerun_spikes = {probe_at: {0: 1.0}} if probe_at else None
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    model = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)  # two pipeline stages
    result = train(ctx, RunConfig(model=model, layout=Layout(**layout), steps=4), hooks, resume=False)
    return {"digest": result.model_digest, "probes": results}


@pytest.mark.parametrize("layout", [
    {"dp": 2, "zero_stage": 1},
    {"dp": 2, "tp": 2},
    {"dp": 2, "pp": 2, "schedule": "1f1b", "num_microbatches": 2},
], ids=["zero1", "tp2", "pp2-1f1b"])
def test_the_swap_probe_gives_each_batch_the_same_norm_on_its_peer_and_leaves_no_trace(layout) -> None:
    """Each rank's batch computed by its DP predecessor gives the norm the rank got (the probe's
    premise, in layouts whose ranks hold shards of TP or pipeline stages), and training after the
    probe ends with the weights of a run without it."""
    world = 2 * layout.get("tp", 1) * layout.get("pp", 1)
    probed = run_ranks(world, _probed_run, (layout, 3))
    clean = run_ranks(world, _probed_run, (layout, None))

    for out in probed:
        assert len(out["probes"]) == 1 and swap.follows_data(out["probes"][0], range(world)), out["probes"]
        assert all(own > 0 for own, _ in out["probes"][0].values())
    assert [o["digest"] for o in probed] == [o["digest"] for o in clean]


def _overflowing_loss(rank: int, world: int, ckpt: str) -> dict:
    """Every rank's loss at step FAULT_STEP is non-finite, on the first run and on the re-run: the
    training diverged alike everywhere (an lr too high would do it), no rank singled out."""
    import torch

    from training.config.run import CheckpointConfig
    from training.data.sources import make_data_source
    from training.hooks import TrainHooks
    from training.model.transformer import Transformer

    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=6,
                    checkpoint=CheckpointConfig(dir=ckpt, every_steps=2))
    source = make_data_source(cfg.data, cfg.model, cfg.global_batch)
    bad = [b for r in range(world) for b in source.batch(FAULT_STEP, r, world)[1]]
    loss = Transformer.loss

    def overflowing(self, logits, targets):
        out = loss(self, logits, targets)
        return out * float("inf") if any(torch.equal(t, b) for t in targets for b in bad) else out

    Transformer.loss = overflowing
    return train_to_integrity_error(rank, world, cfg, TrainHooks(), resume=False)


def test_a_loss_every_replica_loses_again_on_the_re_run_is_reported_reproduced(tmp_path) -> None:
    """Nobody singled out (every rank named): the verdict still says what the re-run showed. It
    used to say `transient: true` (the default when no replica vote or single rank spoke) for a
    non-finite loss the re-run had just reproduced."""
    out = run_ranks(2, _overflowing_loss, (str(tmp_path),))
    assert repr(out[0]) == repr(out[1]), out  # agreed on every rank (repr: the evidence holds NaN)
    ev = out[0]["evidence"]
    assert out[0]["kind"] == "nonfinite" and out[0]["step"] == FAULT_STEP and out[0]["ranks"] == [0, 1], out
    assert ev["diverged"]["what"] == "loss", ev
    assert ev["transient"] is False and ev["reproduced"] is True, ev
