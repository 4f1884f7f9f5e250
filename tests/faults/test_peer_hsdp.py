"""Peer recovery under ZeRO-2/3 with HSDP (issue 17, `layout.dp_replicate`): FSDP shards the state
within each replicate group, so every shard has a copy in each other group, and a lost rank comes
back from the rank at its position in another group with no step lost and the weights bit-identical
to a fault-free run. Plain ZeRO-2/3 (one copy of each shard) and a shard lost in every group use the
checkpoint, and the event says why. The path choice is pure logic; the cell runs the real
controller, rank actors and gloo."""

from __future__ import annotations

import pytest

from tests.faults.harness import (
    assert_succeeded_like_fault_free,
    events,
    job_cfg,
    options,
    run_job,
    wait_for_free_gpus,
)
from tests.faults.test_recovery_path import _cfg, _ranks
from training.config.layout import Layout, LayoutError
from workers.recovery_path import choose


@pytest.mark.parametrize("zero", [2, 3])
def test_a_lost_rank_takes_the_same_shard_from_another_replicate_group(zero):
    layout = Layout(dp=4, zero_stage=zero, dp_replicate=2)  # shards {0, 2} and {1, 3}
    cases = [({1}, {1: 3}), ({2}, {2: 0}), ({0, 1}, {0: 2, 1: 3})]
    for lost, sources in cases:
        ranks = _ranks(layout)
        path = choose(_cfg(layout), ranks, lost, {r.rank: 4 for r in ranks if r.rank not in lost})
        assert (path.path, path.step, path.sources) == ("peer", 4, sources), (lost, path)
    tp2 = Layout(tp=2, dp=6, zero_stage=zero, dp_replicate=3)  # a TP pair per dp rank, shards of 2
    lost = {2, 3}  # dp 1: its copies are dp 3 and dp 5 (ranks 6, 7 and 10, 11)
    path = choose(_cfg(tp2), _ranks(tp2), lost, {r: 1 for r in range(12) if r not in lost})
    assert (path.path, path.sources) == ("peer", {2: 6, 3: 7})


def test_fsdp_uses_the_checkpoint_when_a_shard_has_no_surviving_copy():
    cases = [
        (Layout(dp=4, zero_stage=3), {1}, "ZeRO-3 shards the optimizer state"),
        (Layout(dp=4, zero_stage=2), {0}, "dp_replicate > 1 keeps one"),
        (Layout(dp=4, zero_stage=3, dp_replicate=2), {1, 3}, "rank 1 has no healthy DP peer"),
    ]
    for layout, lost, why in cases:
        ranks = _ranks(layout)
        path = choose(_cfg(layout), ranks, lost, {r.rank: 3 for r in ranks if r.rank not in lost})
        assert path.path == "checkpoint" and why in path.why, (path, why)


def test_shard_peers_and_what_the_layout_refuses():
    hsdp = Layout(dp=4, zero_stage=3, dp_replicate=2)
    assert hsdp.dp_shard == 2
    assert [hsdp.shard_peers(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert Layout(dp=3).shard_peers(1) == [0, 2]  # ZeRO-0: every replica
    assert Layout(dp=4, zero_stage=3).shard_peers(0) == []
    for bad, field in [(dict(dp=4, zero_stage=3, dp_replicate=3), "must divide dp"),
                       (dict(dp=4, zero_stage=1, dp_replicate=2), "zero_stage 2 or 3"),
                       (dict(dp=2, cp=2, zero_stage=3, dp_replicate=2), "cp = 1"),
                       (dict(dp=4, zero_stage=3, dp_replicate=0), "dp_replicate must be an integer")]:
        with pytest.raises(LayoutError, match=field):
            Layout(**bad)


@pytest.mark.ray
class TestCells:
    @pytest.fixture(autouse=True)
    def _free_cluster(self, ray_cluster):
        wait_for_free_gpus(16)
        yield

    def test_a_lost_node_with_one_replicate_group_comes_back_from_the_other_with_no_step_lost(
            self, tmp_path, revive_nodes, two_free_gpus_per_node):
        """dp 4 = 2 replicate groups x 2 shards, two ranks per node: the node holding ranks 0 and 1
        (one whole copy of the sharded state) dies; both move and take their shards from ranks 2
        and 3, 0 steps lost, weights bit-identical to a fault-free run."""
        cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=4, zero_stage=3, dp_replicate=2), steps=8)
        snap = run_job("peer-hsdp-node", cfg, options({"kind": "kill_node", "rank": 1, "at_step": 4}))
        assert_succeeded_like_fault_free(snap, cfg)
        restart = events(snap, "restart")[0]
        assert restart["recovery"]["path"] == "peer", restart
        assert sorted(restart["replaced"]) == [0, 1]
        assert restart["recovery"]["sources"] == {"0": 2, "1": 3}
        restore = events(snap, "restore")[0]
        assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
        assert snap["faults"]["steps_lost"] == 0

    def test_a_killed_hsdp_rank_comes_back_from_its_replica_with_no_step_lost(self, tmp_path):
        """Rank 1 dies alone: rank 0 fails out of the reduce-scatter it shared with it, and rank 2,
        in the replicate all-reduce with rank 0, fails too once rank 0 severs its gloo connections
        (training.parallel.links), so every survivor keeps its state and rank 3 sends rank 1's."""
        cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=4, zero_stage=3, dp_replicate=2))
        snap = run_job("peer-hsdp-rank", cfg, options({"kind": "kill_rank", "rank": 1, "at_step": 3}))
        assert_succeeded_like_fault_free(snap, cfg)
        restart = events(snap, "restart")[0]
        assert restart["recovery"]["path"] == "peer", restart
        assert restart["replaced"] == [1]
        assert restart["recovery"]["sources"] == {"1": 3}
        restore = events(snap, "restore")[0]
        assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
        assert snap["faults"]["steps_lost"] == 0


def test_a_replan_keeps_the_shard_groups_when_it_can():
    from workers.controller.elastic import grow_layout
    from workers.policies import keep_global_batch_replanner
    from workers.topology import NodeInfo, Topology

    hsdp = Layout(dp=4, zero_stage=3, dp_replicate=2, num_microbatches=1)  # shards of 2 ranks
    assert hsdp.with_dp(2, 2) == Layout(dp=2, zero_stage=3, dp_replicate=1, num_microbatches=2)
    assert hsdp.with_dp(8, 1).dp_replicate == 4  # growing: more groups of the same 2 ranks
    assert hsdp.with_dp(3, 1).dp_replicate == 1  # no group of 2 fits 3: plain ZeRO-3 over 3
    assert Layout(dp=4, zero_stage=3).with_dp(2, 2).dp_replicate == 1
    nodes = tuple(NodeInfo(node_id=f"n{i}", name=f"n{i}", rack="r", gpus_total=1, gpus_free=1)
                  for i in range(3))
    shrunk = keep_global_batch_replanner(Topology(nodes=nodes), hsdp)
    assert shrunk == Layout(dp=2, zero_stage=3, num_microbatches=2)  # global batch kept, ZeRO-3 over 2
    # growing back (fault_tolerance.elastic) restores the planned layout's replicate groups
    free = Topology.uniform(1, 2, 2)
    assert grow_layout(shrunk, free, {}, max_gpus=4, planned=hsdp) == hsdp
    assert grow_layout(shrunk, free, {}, max_gpus=4) == Layout(dp=4, zero_stage=3, num_microbatches=1)
