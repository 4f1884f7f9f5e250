"""Peer recovery under ZeRO-1 with shadow shards (issue 17, fault_tolerance.shadow_optimizer): the
lost rank's optimizer shard comes from the rank that shadows it, nothing rolls back and the run ends
bit-identical to a fault-free one (with or without shadows). Without shadows, or when a shard was
lost with its shadow, the checkpoint is used and the event says why. The path choice is pure logic;
the cells run the real controller, rank actors and gloo."""

from __future__ import annotations

import dataclasses

import pytest

from tests.faults.harness import (
    assert_succeeded_like_fault_free,
    events,
    fault_free_digest,
    job_cfg,
    options,
    run_job,
    wait_for_free_gpus,
)
from tests.faults.test_recovery_path import _cfg, _ranks
from training.config.layout import Layout
from workers.recovery_path import choose

Z1 = dict(zero_stage=1)
ON = {"shadow_optimizer": True}


def test_each_lost_rank_takes_the_rank_that_shadows_its_shard():
    cases = [(2, {0}, {0: 1}), (2, {1}, {1: 0}), (3, {0}, {0: 2}), (4, {1, 3}, {1: 0, 3: 2})]
    for dp, lost, sources in cases:
        layout = Layout(dp=dp, **Z1)
        ranks = _ranks(layout)
        kept = {r.rank: 5 for r in ranks if r.rank not in lost}
        path = choose(_cfg(layout, shadow_optimizer=True), ranks, lost, kept)
        assert (path.path, path.step, path.sources) == ("peer", 5, sources), (dp, lost, path)
    tp2 = Layout(tp=2, dp=3, **Z1)  # a replica's TP pair: each takes dp - 1 at its own tp coordinate
    path = choose(_cfg(tp2, shadow_optimizer=True), _ranks(tp2), {2, 3}, {r: 1 for r in (0, 1, 4, 5)})
    assert (path.path, path.sources) == ("peer", {2: 0, 3: 1})


def test_zero1_uses_the_checkpoint_when_a_shard_has_no_surviving_copy():
    cases = [
        (Layout(dp=2, **Z1), {}, {0}, "fault_tolerance.shadow_optimizer keeps one"),
        (Layout(dp=3, **Z1), ON, {1, 2}, "rank 2's ZeRO-1 shard was lost with its shadow"),
        (Layout(dp=2, **Z1), {**ON, "precision": "bf16_fp32_adam"}, {0}, "fp32 runs only"),
        (Layout(dp=2, cp=2, **Z1), ON, {0}, "context parallelism"),
        (Layout(dp=2, zero_stage=2), ON, {0}, "ZeRO-2 shards the optimizer state"),
    ]
    for layout, kw, lost, why in cases:
        ranks = _ranks(layout)
        path = choose(_cfg(layout, **kw), ranks, lost, {r.rank: 3 for r in ranks if r.rank not in lost})
        assert path.path == "checkpoint" and why in path.why, (path, why)


@pytest.mark.ray
class TestCells:
    @pytest.fixture(autouse=True)
    def _free_cluster(self, ray_cluster):
        wait_for_free_gpus(16)
        yield

    # dp 3 is the slow variant (`make test-slow`)
    @pytest.mark.parametrize("dp, rank", [(2, 0), pytest.param(3, 1, marks=pytest.mark.slow)])
    def test_a_killed_zero1_rank_comes_back_from_its_shadow_with_no_step_lost(self, tmp_path, dp, rank):
        cfg = dataclasses.replace(job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=dp, **Z1)),
                                  shadow_optimizer=True)
        snap = run_job(f"peer-zero1-dp{dp}", cfg, options({"kind": "kill_rank", "rank": rank, "at_step": 3}))
        assert_succeeded_like_fault_free(snap, cfg)
        # the shadows change no bit of the weights: a run without them ends the same
        assert fault_free_digest(dataclasses.replace(cfg, shadow_optimizer=False)) == fault_free_digest(cfg)
        restart = events(snap, "restart")[0]
        assert restart["recovery"]["path"] == "peer", restart
        assert restart["replaced"] == [rank]
        assert restart["recovery"]["sources"] == {str(rank): (rank - 1) % dp}
        restore = events(snap, "restore")[0]
        assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
        assert snap["faults"]["steps_lost"] == 0

    def test_without_shadows_zero1_restores_the_checkpoint_and_says_why(self, tmp_path):
        cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=2, **Z1))
        snap = run_job("peer-zero1-noshadow", cfg, options({"kind": "kill_rank", "rank": 1, "at_step": 3}))
        assert_succeeded_like_fault_free(snap, cfg)
        recovery = events(snap, "restart")[0]["recovery"]
        assert recovery["path"] == "checkpoint"
        assert "ZeRO-1 shards the optimizer state" in recovery["why"]
        assert "shadow_optimizer" in recovery["why"]
        restore = events(snap, "restore")[0]
        assert (restore["source"], restore["step"]) == ("checkpoint", 2)
