"""A statistical gradient check settled before the optimizer step (training.integrity.before_update),
where no pre-step snapshot is kept: a transient fault is named and never reaches the weights. Real
train loop on 2 gloo ranks (ZeRO-1: no snapshot). The data's own spikes, re-run there and accepted:
tests/training/test_gradient_spike.py."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec
from training.integrity.attribution import AuditConfig

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)
LAYOUT = Layout(dp=2, zero_stage=1)
FLIP_STEP = 5  # after the spike check's warm-up


def _run(rank: int, world: int, steps: int, flip: bool) -> dict:
    import torch

    from training.hooks import Action, TrainHooks
    from training.integrity.injection import BitFlipInjector
    from training.parallel.dist import DistContext
    from training.train import train

    errors: list[dict] = []

    class Hooks(TrainHooks):
        def on_integrity_error(self, error) -> Action:
            errors.append({"kind": error.kind, "step": error.step, "ranks": error.ranks,
                           "transient": error.evidence.get("transient"),
                           "attribution": error.evidence.get("attribution")})
            return Action.STOP

    class OnceFaulty(BitFlipInjector):
        """Rank 1's device scales one gradient by 1e4 the first time it computes FLIP_STEP (an exponent
        flip would overflow this small model's norm: the `nonfinite` check, exact, not statistical)."""

        fired = False

        def arm_grad_flips(self, step, named_params):  # called before every backward of a step
            for _, handle in self._armed:
                handle.remove()
            self._armed = []
            if step == FLIP_STEP and self.rank == 1 and not self.fired:
                OnceFaulty.fired = True
                _, p = max(named_params, key=lambda item: item[1].numel())
                self._armed.append((None, p.register_hook(lambda g: g * 1e4)))
            return []

    hooks = Hooks()
    hooks.audit = AuditConfig(grad_checks=False)  # the local spike check alone (a statistical one)
    hooks.injector = OnceFaulty([], rank) if flip else None
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    result = train(ctx, RunConfig(model=SPEC, layout=LAYOUT, steps=steps), hooks, resume=False)
    return {"errors": errors, "final": result.final_step, "digest": result.model_digest}


def test_a_transient_gradient_fault_is_named_before_it_reaches_the_weights() -> None:
    flipped = run_ranks(2, _run, (10, True))
    assert flipped[0]["errors"] == flipped[1]["errors"] == [
        {"kind": "grad_norm_spike", "step": FLIP_STEP, "ranks": [1], "transient": True,
         "attribution": "re-run before the update"}], flipped[0]
    # The step was applied with the re-run's gradients: the weights where the run stopped are those
    # of a clean run of as many steps, to the bit.
    assert [r["final"] for r in flipped] == [FLIP_STEP] * 2
    assert flipped[0]["digest"] == run_ranks(2, _run, (FLIP_STEP, False))[0]["digest"]


@pytest.mark.parametrize(("dp", "zero", "snapshot", "expected"), [
    (2, 0, "auto", False),  # the pre-step snapshot re-runs it (training.integrity.rerun)
    (2, 1, "auto", True),
    (3, 0, "auto", True),
    (3, 0, "always", False),
    (4, 3, "auto", True),
    (1, 0, "auto", True),
    (2, 1, "never", False),  # re-runs off: the restart re-runs it (training.integrity.settle)
])
def test_which_layouts_settle_a_check_before_the_update(dp, zero, snapshot, expected) -> None:
    assert AuditConfig(snapshot=snapshot).settles_before_update(dp, zero) is expected
    assert AuditConfig(snapshot=snapshot, local_grad_check=False, grad_checks=False).settles_before_update(
        dp, zero) is False  # no statistical check to fire: no agreement each step
