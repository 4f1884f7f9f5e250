"""One case of each fault kind, at the workers level: a real controller, real rank
actors on the shared Ray cluster, real gloo training. Each job must succeed with the fault-free
run's weights, train on every sample exactly once, keep the culprit out, and log the story in
order. The full matrix (every kind x early / mid-run / during a checkpoint save) is in
test_fault_matrix.py, marked slow."""

from __future__ import annotations

import pytest

from tests.faults.harness import (
    assert_corruption_caught_before_restore,
    assert_in_order,
    assert_kept_off,
    assert_succeeded_like_fault_free,
    events,
    job_cfg,
    options,
    run_job,
    sdc_attribution,
    wait_for_free_gpus,
)

pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


def test_kill_rank_is_detected_and_only_the_dead_rank_is_replaced(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job("ft-kill-rank", cfg, options({"kind": "kill_rank", "rank": 1, "at_step": 3}))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "node_suspect", "restart", "restore",
                           "resumed", "finished"])
    failure = events(snap, "failure")[0]
    assert failure["failure"]["kind"] == "rank_died" and failure["failure"]["ranks"] == [1]
    assert failure["time_to_detect_s"] is not None
    restart = events(snap, "restart")[0]
    # Rank 1's DP peer (rank 0) holds the state of step 3: the replacement takes it, nothing rolls back.
    assert restart["path"] == "peer" and restart["replaced"] == [1]
    assert restart["recovery"]["sources"] == {"1": 0} and restart["recovery"]["step"] == 3
    restore = events(snap, "restore")[0]
    assert (restore["step"], restore["steps_lost"], restore["source"]) == (3, 0, "peers")
    assert snap["faults"]["steps_lost"] == 0
    assert snap["restarts"] == 1 and snap["faults"]["restarts_by_cause"] == {"rank_died": 1}
    assert events(snap, "resumed")[0]["time_to_recover_s"] is not None


def test_hang_is_attributed_to_the_rank_that_never_entered_the_collective(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job("ft-hang", cfg, options({"kind": "hang_rank", "rank": 0, "at_step": 3}))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "node_suspect", "restart", "restore",
                           "resumed", "finished"])
    failure = events(snap, "failure")[0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [0]
    assert failure["evidence"]["waiting_in_collective"] == [1]
    assert events(snap, "restart")[0]["path"] == "peer"  # the waiting rank kept step 3
    assert events(snap, "restore")[0]["step"] == 3


def test_straggler_is_found_by_its_late_arrivals_and_moved_off_its_node(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    opts = options({"kind": "slow_rank", "rank": 1, "at_step": 1, "seconds": 1.0}, straggler_steps=2,
                   straggler_lag_s=0.5)
    snap = run_job("ft-slow", cfg, opts)
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "node_suspect", "restart", "restore",
                           "resumed", "finished"])
    failure = events(snap, "failure")[0]["failure"]
    assert failure["kind"] == "straggler" and failure["ranks"] == [1]
    assert all(lag["rank"] == 1 and lag["lag_s"] > 0.5 for lag in failure["evidence"]["lags"])
    # The straggler moves off its node (its healthy peer keeps its process and its place).
    restart = events(snap, "restart")[0]
    assert restart["path"] == "peer" and restart["replaced"] == [1]
    moved = next(r for r in restart["placement"] if r["rank"] == 1)
    assert moved["node_name"] != failure["nodes"][0]


def test_bitflip_in_one_of_two_replicas_is_attributed_by_rerun_and_its_node_quarantined(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    flip = {"kind": "bitflip", "rank": 1, "at_step": 3, "target": "param", "bit": 30, "index": 7}
    snap = run_job("ft-bitflip", cfg, options(flip))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "integrity_error", "failure", "attributed", "node_quarantined",
                           "restart", "restore", "resumed", "finished"])
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [1] and attributed["transient"] is True
    evidence = attributed["evidence"]["evidence"]
    assert evidence["votes"][0]["reproduced"] == {"0": True, "1": False}
    node = attributed["nodes"][0]
    assert snap["quarantined_nodes"] == [node]
    assert events(snap, "restore")[0]["step"] == 2  # step 3 was never verified
    assert_kept_off(snap, node, "node_quarantined")


# The referee started on demand (spares: 0) is the slow variant (`make test-slow`).
@pytest.mark.parametrize("spares", [pytest.param(0, id="on-demand", marks=pytest.mark.slow),
                                    pytest.param(1, id="hot-spare")])
def test_persistent_flip_with_two_replicas_is_settled_by_a_spare(tmp_path, spares):
    """The re-run reproduces the flip (a faulty device), so two replicas cannot tell which is wrong;
    a spare on a third, healthy node replays the step and names the replica it disagrees with: the
    job's warm hot spare when it keeps one, else a process started for it."""
    cfg = job_cfg(str(tmp_path / "ckpt"))
    flip = {"kind": "bitflip", "rank": 1, "at_step": 3, "target": "param", "bit": 30, "index": 7,
            "persistent": True}
    snap = run_job(f"ft-referee-{spares}", cfg, options(flip, spares=spares))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "integrity_error", "failure", "referee_started", "referee",
                           "attributed", "node_quarantined", "restart", "restore", "resumed", "finished"])
    integrity = events(snap, "integrity_error")[0]
    assert sorted(integrity["ranks"]) == [0, 1] and integrity["evidence"]["transient"] is False
    started, referee = events(snap, "referee_started")[0], events(snap, "referee")[0]["referee"]
    assert referee["culprits"] == [1] and referee["healthy"] == [0]
    assert referee["fingerprint"] == referee["fingerprints"]["0"] != referee["fingerprints"]["1"]
    assert referee["node"] not in started["suspects"]  # the spare ran outside both replicas' nodes
    assert referee["warm_spare"] is (spares == 1)
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [1]
    node = attributed["nodes"][0]
    assert snap["quarantined_nodes"] == [node]  # the healthy replica's node is not punished
    assert_kept_off(snap, node, "node_quarantined")


def test_corrupt_checkpoint_is_never_restored(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    faults = ({"kind": "corrupt_checkpoint", "at_step": 4}, {"kind": "kill_rank", "rank": 0, "at_step": 5})
    # The peer path would not need the checkpoint at all: the checkpoint path is the one under test.
    snap = run_job("ft-corrupt", cfg, options(*faults, peer_recovery=False))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "restart", "restore", "resumed",
                           "finished"])
    assert_corruption_caught_before_restore(snap, 4)
    detected = next(e for e in events(snap, "failure") if e["failure"]["kind"] == "checkpoint")
    assert "damaged" in detected["failure"]["message"]
    assert events(snap, "restore")[0]["step"] == 2  # the newest verified, undamaged checkpoint


def test_kill_node_is_a_node_death_and_the_job_moves_to_healthy_nodes(tmp_path, revive_nodes):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job("ft-kill-node", cfg, options({"kind": "kill_node", "rank": 1, "at_step": 3}))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "node_dead", "restart", "restore",
                           "resumed", "finished"])
    failure = events(snap, "failure")[0]["failure"]
    node = events(snap, "fault_injected")[0]["node"]
    assert failure["kind"] == "node_died" and failure["nodes"] == [node]
    assert revive_nodes.killed == [node]
    restart = events(snap, "restart")[0]
    assert restart["path"] == "full"
    assert restart["recovery"]["why"] == "the node death took every rank", restart  # DP 2 on one node
    assert_kept_off(snap, node, "node_dead")
