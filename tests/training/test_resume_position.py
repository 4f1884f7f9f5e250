"""What a restart resumes from when the ranks' own reports are lost (issue 17's flaky cells):

- a checkpoint saved after its step's integrity checks passed says so itself (integrity.json, under
  the manifest), so a restart takes it even when the controller never heard the rank's "verified"
  report (the rank died with it unread); one saved at an unchecked step is still refused;
- the state a rank keeps for a peer recovery carries the data position of the step it kept, even
  when the rank failed inside the next step after reading that step's batch.

Real train loop on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed import run_ranks
from training.checkpoint.manifest import INTEGRITY, vouched_steps
from training.config.layout import Layout
from training.config.run import CheckpointConfig, IntegrityConfig, RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)


def _cfg(root: str, steps: int) -> RunConfig:
    # Replicas compared every 2nd step: the checkpoints of odd steps are saved unchecked.
    return RunConfig(model=SPEC, layout=Layout(dp=2), steps=steps,
                     checkpoint=CheckpointConfig(dir=root, every_steps=1, keep=5),
                     integrity=IntegrityConfig(fingerprint_every=2))


def _resume_worker(rank: int, world: int, root: str) -> dict:
    import torch

    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    train(ctx, _cfg(root, 3), resume=False)
    heard_nothing = TrainHooks()
    heard_nothing.restore_steps = set()  # the controller saw no "verified" report at all
    resumed = train(ctx, _cfg(root, 4), heard_nothing).resumed_from
    return {"resumed": resumed}


def test_a_restart_takes_the_newest_checkpoint_saved_verified_though_its_report_was_lost(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _resume_worker, (root,))
    marks = {s: json.loads((Path(root) / f"step-{s}" / INTEGRITY).read_text())["verified"] for s in (1, 2, 3)}
    assert marks == {1: False, 2: True, 3: False}
    assert vouched_steps(root) == {2, 4}  # the second run's step 4 was checked too
    assert [r["resumed"] for r in results] == [2, 2]  # step 3 is newer but was never checked


def _capture_worker(rank: int, world: int) -> dict:
    import torch

    from training.checkpoint import peer
    from training.data.sources import make_data_source
    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import Trainer

    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=4)
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    trainer = Trainer(ctx, cfg, TrainHooks())
    trainer.updating = False
    for step in (1, 2):
        trainer.train_step(step)
    trainer.data.batch(3, trainer.dims.dp_rank, trainer.dims.dp_size)  # step 3 read, then a peer died
    kept = peer.capture(trainer)
    resumed = make_data_source(cfg.data, cfg.model, cfg.global_batch)
    resumed.load_state_dict(kept.data)  # what the next attempt does with the kept state
    fresh = make_data_source(cfg.data, cfg.model, cfg.global_batch)
    return {"step": kept.step, "next_step": kept.data["next_step"],
            "same_next": resumed.positions(3, rank, world) == fresh.positions(3, rank, world)}


def test_a_rank_failing_inside_a_step_keeps_the_data_position_of_the_step_before():
    results = run_ranks(2, _capture_worker, ())
    assert results == [{"step": 2, "next_step": 3, "same_next": True}] * 2


def test_a_data_position_after_a_step_ignores_a_later_batch_already_read():
    from training.config.run import DataConfig
    from training.data.sources import DataError, make_data_source

    src = make_data_source(DataConfig(), SPEC, 4)
    for step in (1, 2, 3):
        src.batch(step, 0, 1)
    assert src.state_dict(after_step=2) == {**src.state_dict(), "next_step": 3, "samples_consumed": 12}
    resumed = make_data_source(DataConfig(), SPEC, 4)
    resumed.load_state_dict(src.state_dict(after_step=2))
    assert resumed.positions(3, 0, 1) == src.positions(3, 0, 1)
    with pytest.raises(DataError, match="precedes the resumed data position"):
        resumed.state_dict(after_step=1)  # before where this source resumed: not a position it had

