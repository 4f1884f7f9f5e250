"""Peer recovery (issue 17): a lost rank with a healthy DP peer gets the peer's in-memory state over
the collective backend, so nothing rolls back; without one (DP = 1) the checkpoint is used, and the
restart event says which path was taken and why. Real controller, rank actors and gloo."""

from __future__ import annotations

import dataclasses

import pytest

from tests.faults.harness import (
    EVERY,
    assert_in_order,
    assert_succeeded_like_fault_free,
    events,
    job_cfg,
    options,
    run_job,
    wait_for_free_gpus,
)
from tests.local_procs import processes_with_env, until
from training.config.layout import Layout

pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


def _peer_restart(snap: dict) -> dict:
    restart = events(snap, "restart")[0]
    assert restart["path"] == "peer", [(e["kind"], e.get("message")) for e in snap["events"]]
    return restart


def test_a_whole_tp_group_lost_with_its_node_comes_back_from_the_other_replica(
        tmp_path, revive_nodes, two_free_gpus_per_node):
    """TP 2 x DP 2: the node holding one replica's TP pair dies; both ranks move to another node and
    take the other replica's state (same tp coordinate); the run ends bit-identical to a fault-free
    one, 0 steps lost. The node they move to held two warm processes for them (the standby node of
    workers.warm_workers); a job-unique environment keeps other tests' warm processes out."""
    cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(tp=2, dp=2), steps=10)
    snap = run_job("peer-kill-node", cfg, options({"kind": "kill_node", "rank": 2, "at_step": 7},
                                                  env_vars={"LATTICE_TEST_STANDBY": tmp_path.name}))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "node_dead", "restart", "restore", "resumed",
                           "finished"])
    restart = _peer_restart(snap)
    lost = sorted(restart["replaced"])
    assert len(lost) == 2, [(e["kind"], e.get("message")) for e in snap["events"]]
    by_rank = {r["rank"]: r for r in restart["placement"]}
    for r in lost:  # each lost rank's source holds the same TP shard in the other replica
        src = restart["recovery"]["sources"][str(r)]
        assert src not in lost and by_rank[src]["tp"] == by_rank[r]["tp"]
        assert by_rank[src]["dp"] != by_rank[r]["dp"]
    dead = events(snap, "node_dead")[0]["node"]
    assert all(by_rank[r]["node_name"] != dead for r in lost)
    assert len({by_rank[r]["node_name"] for r in lost}) == 1  # the TP pair stays inside one node
    assert restart["spare_used"] is False and restart["warm_process"] is True, restart
    restore = events(snap, "restore")[0]
    assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
    assert snap["faults"]["steps_lost"] == 0


def test_a_rank_killed_during_a_checkpoint_save_loses_no_step(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job("peer-kill-ckpt", cfg, options({"kind": "kill_rank", "rank": 0, "at_step": EVERY,
                                                   "phase": "checkpoint"}))
    assert_succeeded_like_fault_free(snap, cfg)
    restart = _peer_restart(snap)
    assert restart["replaced"] == [0] and restart["recovery"]["sources"] == {"0": 1}
    assert restart["recovery"]["step"] == EVERY
    assert events(snap, "restore")[0]["steps_lost"] == 0


def test_a_bf16_run_hands_over_its_fp32_masters(tmp_path):
    """bf16 compute with fp32 masters and AdamW state: the peer sends the masters, so the run still
    ends bit-identical to a fault-free one."""
    cfg = dataclasses.replace(job_cfg(str(tmp_path / "ckpt")), precision="bf16_fp32_adam")
    snap = run_job("peer-bf16", cfg, options({"kind": "kill_rank", "rank": 1, "at_step": 3}))
    assert_succeeded_like_fault_free(snap, cfg)
    assert _peer_restart(snap)["recovery"]["sources"] == {"1": 0}
    assert events(snap, "restore")[0]["steps_lost"] == 0


def test_without_a_dp_peer_the_checkpoint_is_restored_and_the_event_says_why(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=1))
    snap = run_job("peer-dp1", cfg, options({"kind": "kill_rank", "rank": 0, "at_step": 3}))
    assert_succeeded_like_fault_free(snap, cfg)
    restart = events(snap, "restart")[0]
    assert restart["path"] == "fast" and restart["recovery"]["path"] == "checkpoint"
    assert "no DP replica" in restart["recovery"]["why"]
    restore = events(snap, "restore")[0]
    assert (restore["source"], restore["step"]) == ("checkpoint", 2)


# The cold start (no warm process) is the slow baseline (`make test-slow`).
@pytest.mark.parametrize("warm", [pytest.param(1, id="warm-process"),
                                  pytest.param(0, id="cold-process", marks=pytest.mark.slow)])
def test_a_replacement_starts_in_the_warm_process_kept_on_its_node(tmp_path, warm):
    """workers.warm_workers: with a warm process kept on the job's nodes the replacement's process
    existed before it was asked for (no process start, no torch import on the recovery path); with
    none it is a new process. Both end bit-identical to a fault-free run. A job-unique environment
    keeps other tests' warm processes (same Ray job, same runtime env) out of the cold cell."""
    cfg = job_cfg(str(tmp_path / "ckpt"), steps=10)
    cell = f"{warm}-{tmp_path.name}"
    opts = options({"kind": "kill_rank", "rank": 1, "at_step": 7}, warm_workers=warm,
                   env_vars={"LATTICE_TEST_WARM_CELL": cell})
    snap = run_job(f"peer-warm-{warm}", cfg, opts)
    assert_succeeded_like_fault_free(snap, cfg)
    restart = _peer_restart(snap)
    assert restart["replaced"] == [1] and restart["spare_used"] is False
    assert restart["warm_process"] is bool(warm), restart
    assert events(snap, "restore")[0]["steps_lost"] == 0
    # The job is over: its ranks and the warm process kept after the replacement took the first are
    # gone, not left idle for the raylet to reap after the keep-alive (ten minutes).
    left = f"LATTICE_TEST_WARM_CELL={cell}"
    assert snap["warm_processes"] == {}  # ended before the controller reported the job finished
    assert until(lambda: not processes_with_env(left)), processes_with_env(left)
