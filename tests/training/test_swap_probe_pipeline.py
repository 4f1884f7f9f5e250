"""Under PP a faulty device's error crosses stage boundaries: a corrupt gradient that a stage sends
upstream makes the *earlier*, healthy stage of its pipeline spike. The swap probe measures what crossed
each stage's boundaries on both pipelines and names the stage where they part (training.integrity.swap):
the faulty device, not the one that spiked (which the probe named before). Real train loop, PP 2 x DP 2
on 4 gloo ranks; the logic of the rule on synthetic boundaries below it."""

from __future__ import annotations

from tests.distributed import run_ranks, train_to_integrity_error
from training.config.layout import Layout
from training.config.spec import ModelSpec
from training.integrity.swap import Boundary, SwapProbe, culprits

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)  # one layer per stage
LAYOUT = {"dp": 2, "pp": 2, "schedule": "1f1b", "num_microbatches": 2}
FAULT_STEP = 4
FAULTY = Layout(**LAYOUT).rank_of(1, 1, 0, 0)  # the last stage of the second pipeline
SPIKING = Layout(**LAYOUT).rank_of(0, 1, 0, 0)  # the stage its corrupt gradient flows into


def _faulty_last_stage(rank: int, world: int, ckpt: str) -> dict:
    """FAULTY's device scales the gradient its stage sends upstream by 1e4 whenever it computes step
    FAULT_STEP (its own parameters' gradients stay right): the first stage of its pipeline spikes."""
    import torch

    from training.config.run import CheckpointConfig, RunConfig
    from training.hooks import TrainHooks
    from training.integrity.injection import BitFlipInjector
    from training.model.transformer import Transformer

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return g * 1e4

    active = [False]

    class FaultyDevice(BitFlipInjector):
        def arm_grad_flips(self, step, named_params):  # called before every backward of a step
            active[0] = step == FAULT_STEP and self.rank == FAULTY
            return []

    forward = Transformer.forward

    def faulty(self, x):
        if active[0] and self.tok_embeddings is None and x.requires_grad:
            x = ScaleGrad.apply(x)
        return forward(self, x)

    Transformer.forward = faulty

    hooks = TrainHooks()
    hooks.injector = FaultyDevice([], rank)
    cfg = RunConfig(model=SPEC, layout=Layout(**LAYOUT), steps=6,
                    checkpoint=CheckpointConfig(dir=ckpt, every_steps=2))
    return train_to_integrity_error(rank, world, cfg, hooks, resume=False)


def test_a_stage_that_sends_a_corrupt_gradient_upstream_is_named_not_the_stage_that_spiked(tmp_path) -> None:
    out = run_ranks(4, _faulty_last_stage, (str(tmp_path),))
    assert all(o == out[0] for o in out), out  # agreed on every rank
    failed = out[0]
    assert failed.get("step") == FAULT_STEP, failed
    ev = failed["evidence"]
    assert ev["swap"]["follows_data"] is False and ev["transient"] is False, ev
    assert str(SPIKING) in ev["swap"]["norms"], ev  # the healthy first stage is the one that spiked
    assert failed["ranks"] == [FAULTY], failed  # ... and the device that sent it the gradient is named
    parted = ev["swap"]["boundaries"]
    own, peer = parted[str(FAULTY)]["own"], parted[str(FAULTY)]["peer"]
    assert own[3] > 100 * peer[3] and own[2] == peer[2], parted  # sent differs, received agrees


# ---- the rule, on synthetic probes: pipeline 1 (ranks 1, 3) against pipeline 0 (ranks 0, 2) --------
OK = Boundary(1.0, 2.0, 3.0, 4.0)


def _probe(norms: dict[int, tuple[float, float]], parted: dict[int, Boundary]) -> SwapProbe:
    return SwapProbe({r: norms.get(r, (1.0, 1.0)) for r in range(4)},
                     {r: (parted.get(r, OK), OK) for r in range(4)})


def test_a_corrupt_activation_names_the_stage_that_produced_it() -> None:
    """Stage 0 of pipeline 1 sends a wrong activation: stage 1 gets other inputs (and spikes), and
    stage 0 gets another gradient back (and spikes too): the stage fed alike that answered otherwise."""
    probe = _probe({1: (9.0, 1.0), 3: (9.0, 1.0)},
                   {1: OK._replace(act_out=7.0, grad_in=7.0), 3: OK._replace(act_in=7.0, grad_in=7.0)})
    assert culprits(probe, [1, 3], Layout(**LAYOUT)) == [1]


def test_a_corrupt_gradient_names_the_last_stage_whose_own_gradient_went_wrong() -> None:
    """Stage 1 of pipeline 1 computes its own weights' gradient wrong and sends a wrong one upstream."""
    probe = _probe({1: (9.0, 1.0), 3: (9.0, 1.0)},
                   {1: OK._replace(grad_in=7.0), 3: OK._replace(grad_out=7.0)})
    assert culprits(probe, [1, 3], Layout(**LAYOUT)) == [3]
    assert culprits(probe, [1], Layout(**LAYOUT)) == [3]  # only the first stage spiked: still stage 1


def test_without_pipelines_each_spiked_rank_whose_batch_changed_with_the_device_is_named() -> None:
    layout = Layout(dp=3)
    probe = SwapProbe({0: (1.0, 1.0), 1: (9.0, 1.0), 2: (1.0, 1.0)}, {})
    assert culprits(probe, [1, 2], layout) == [1]  # rank 2's spike followed its batch
