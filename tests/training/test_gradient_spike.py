"""A gradient spike the data itself produces is not corruption (the bench.recovery job's step 295:
a clean run's local gradient norm 16x its history quarantined both nodes and left the job waiting
for a node forever). The re-run from the pre-step snapshot reproduces it bit for bit on every rank:
the re-run step stands, the hooks hear of it, and training goes on to the fault-free run's weights.
Real train loop on 2 gloo ranks; a spike factor this low makes ordinary steps spikes."""

from __future__ import annotations

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)


def _worker(rank: int, world: int, factor: float | None) -> dict:
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
    if factor is not None:
        hooks.audit = AuditConfig(grad_spike_factor=factor, grad_warmup=2)
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    result = train(ctx, RunConfig(model=SPEC, layout=Layout(dp=2), steps=12), hooks, resume=False)
    return {"digest": result.model_digest, "spikes": spikes, "final": result.final_step}


def test_a_reproduced_gradient_spike_is_the_datas_and_training_goes_on() -> None:
    spiky = run_ranks(2, _worker, (1.0001,))
    clean = run_ranks(2, _worker, (None,))
    assert clean[0]["spikes"] == [] and spiky[0]["spikes"], spiky[0]
    assert spiky[0]["spikes"] == spiky[1]["spikes"]  # agreed: every rank heard the same
    assert all(kind == "grad_norm_spike" and reproduced for kind, _, _, reproduced in spiky[0]["spikes"])
    assert [r["final"] for r in spiky] == [12, 12]
    assert {r["digest"] for r in spiky} == {clean[0]["digest"]}  # the re-run steps are the real ones
