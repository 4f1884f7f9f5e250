"""The integrity checks' histories travel in the checkpoint (training.integrity.history): a restart
checks its first steps against the same "normal" the uninterrupted run had, not a fresh warm-up
during which nothing is checked; a restore into another layout keeps the loss history (the global
loss is the layout's too) but not the per-rank gradient norms (other ranks, other gradients).
Real train loop on real gloo ranks."""

from __future__ import annotations

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)


def _worker(rank: int, world: int, root: str) -> dict:
    import torch

    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import Trainer

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")

    def cfg(layout: Layout) -> RunConfig:
        return RunConfig(model=SPEC, layout=layout, steps=4,
                         checkpoint=CheckpointConfig(dir=root, every_steps=4))

    def histories(t: Trainer) -> tuple[list[float], list[float]]:
        return list(t.spikes.history), list(t.local_check.detector.history)

    first = Trainer(ctx, cfg(Layout(dp=2)), TrainHooks())
    for step in range(1, 5):
        loss, _ = first.train_step(step)
        assert first.check_integrity(step, loss) is None
    first.save()
    first.checkpointer.wait_pending()
    first.close()
    same = Trainer(ctx, cfg(Layout(dp=2)), TrainHooks())
    assert same.restore() == 4
    other = Trainer(ctx, cfg(Layout(dp=2, zero_stage=1)), TrainHooks())
    assert other.restore() == 4
    return {"saved": histories(first), "same": histories(same), "other": histories(other)}


def test_a_restore_brings_back_the_checks_histories(tmp_path) -> None:
    results = run_ranks(2, _worker, (str(tmp_path / "ckpt"),))
    for r in results:
        loss, grad = r["saved"]
        assert len(loss) == 4 and len(grad) == 4  # every step was accepted into both
        assert r["same"] == r["saved"]
        assert r["other"] == (loss, [])  # ZeRO-1's ranks are other ranks: the gradient history starts anew
    assert results[0]["saved"][0] == results[1]["saved"][0]  # the global loss: one history
    assert results[0]["saved"][1] != results[1]["saved"][1]  # each rank's own local norms
