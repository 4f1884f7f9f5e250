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


def _peer_worker(rank: int, world: int) -> dict:
    """Rank 0 survives and keeps its state; rank 1 is replaced and gets rank 0's (a peer recovery)."""
    import torch

    from training.checkpoint.peer import PeerPlan, capture, restore_from_peers
    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import Trainer

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=6)
    first = Trainer(ctx, cfg, TrainHooks())
    for step in range(1, 5):
        loss, _ = first.train_step(step)
        assert first.check_integrity(step, loss) is None
    saved = list(first.spikes.history), list(first.local_check.detector.history)
    kept = capture(first) if rank == 0 else None
    first.close()
    after = Trainer(ctx, cfg, TrainHooks())
    plan = PeerPlan(4, send_to=(1,)) if rank == 0 else PeerPlan(4, receive_from=0)
    assert restore_from_peers(after, plan, kept) == 4
    return {"saved": saved, "after": (list(after.spikes.history), list(after.local_check.detector.history))}


def test_a_peer_recovery_carries_the_checks_histories() -> None:
    """No checkpoint in between: the survivor keeps its own histories; the replacement takes the
    global loss history and, for its own-history gradient check, its DP peer's norms."""
    survivor, replacement = run_ranks(2, _peer_worker, ())
    assert len(survivor["saved"][1]) == 4 and survivor["after"] == survivor["saved"]
    assert replacement["after"] == (survivor["saved"][0], survivor["saved"][1])
