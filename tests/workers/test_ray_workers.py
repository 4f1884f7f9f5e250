"""Against a real local Ray cluster (one per session, see conftest): where actors really land,
gang reservation, and the controller actor running, reporting and cancelling jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group_table

from tests.distributed import run_ranks
from tests.waiting import wait_for
from training.checkpoint.checkpointer import list_checkpoints
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.controller import ControllerOptions, get_controller, kill_controller, start_controller
from workers.placement import ReservationTimeout, place, release, reserve
from workers.topology import Topology
from workers.worker_group import RayWorkerGroup

pytestmark = pytest.mark.ray

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
DP2_PP2_TP2 = Layout(tp=2, pp=2, dp=2, num_microbatches=2, schedule="1f1b")
STANDIN = "tests.workers.standin:allreduce_train"


def wait_for_free_gpus(n: int, timeout_s: float = 30.0) -> None:
    wait_for(lambda: Topology.from_ray().gpus_free == n, timeout_s, f"{n} free GPUs")


def poll_until(handle: Any, done: Any, timeout_s: float) -> dict:
    return wait_for(lambda: (lambda s: s if done(s) else None)(ray.get(handle.poll.remote(0))), timeout_s,
                    "the controller", interval_s=0.5)


def tp_groups_share_a_node(placement: list[dict]) -> bool:
    groups: dict[tuple, set] = {}
    for r in placement:
        groups.setdefault((r["pp"], r["dp"], r["cp"]), set()).add(r["node_id"])
    return all(len(nodes) == 1 for nodes in groups.values())


def test_embedded_cluster_has_the_racks_nodes_gpus_and_labels(ray_cluster):
    wait_for_free_gpus(16)
    topo = Topology.from_ray()
    assert {r: [n.name for n in ns] for r, ns in topo.racks.items()} == {
        "r1": ["r1-n1", "r1-n2"], "r2": ["r2-n1", "r2-n2"],
    }
    for n in topo.gpu_nodes:
        assert n.gpus_total == 4 and n.alive and n.health == "ready"
        assert n.labels["rack"] == n.rack and n.labels["node_name"] == n.name
    heads = [n for n in topo.nodes if n.is_head]
    assert len(heads) == 1 and heads[0].gpus_total == 0
    assert set(ray_cluster.node_ids()) == {"r1-n1", "r1-n2", "r2-n1", "r2-n2"}
    d = Topology.from_ray({"r1-n1": "quarantined"}, ["r2-n2"]).to_dict()
    assert (d["gpus_total"], d["gpus_free"], d["gpus_schedulable"]) == (16, 16, 8)


def test_rank_actors_land_where_placement_said(ray_cluster):
    wait_for_free_gpus(16)
    placement = place(DP2_PP2_TP2, Topology.from_ray())
    group = RayWorkerGroup("landing")
    try:
        group.reserve(placement)
        actual = [r.to_dict() for r in group.spawn()]
        assert Topology.from_ray().gpus_free == 8
    finally:
        group.shutdown()
    assert [(r["rank"], r["node_id"]) for r in actual] == [(r.rank, r.node_id) for r in placement.ranks]
    assert tp_groups_share_a_node(actual)
    stage_racks = [{r["rack"] for r in actual if r["pp"] == s} for s in range(2)]
    assert all(len(racks) == 1 for racks in stage_racks) and stage_racks[0] != stage_racks[1]
    gpus = [(r["node_id"], r["gpu"]) for r in actual]
    assert len(set(gpus)) == 8 and all(0 <= g < 4 for _, g in gpus)  # real ids from ray.get_gpu_ids()
    wait_for_free_gpus(16)


@pytest.mark.parametrize("standby", [True, False])
def test_standby_nodes_get_warm_processes_only_where_the_option_says(ray_cluster, standby):
    """A DP 8 job on two nodes: with warm_standby the group also asks for warm processes on the nodes
    its ranks would move to if one of its nodes were lost (4 each: workers.relocate; nothing is
    reserved here, so a standby node may be the other job node), without it (the service's default on
    CPU node types) only on the job's own nodes."""
    placement = place(Layout(dp=8), Topology.from_ray())
    job_nodes = {r.node_id for r in placement.ranks}
    assert len(job_nodes) == 2
    kept_standby = RayWorkerGroup("standby", warm_standby=standby).standby_for(placement.ranks)
    if standby:
        assert kept_standby and set(kept_standby.values()) == {4}, kept_standby  # a lost node's 4 ranks
    else:
        assert kept_standby == {}


def test_cordoned_and_quarantined_nodes_receive_no_ranks(ray_cluster):
    wait_for_free_gpus(16)
    layout = Layout(tp=2, dp=2)  # fits the first node, r1-n1, when nothing is excluded
    assert {r.node_name for r in place(layout, Topology.from_ray()).ranks} == {"r1-n1"}
    topo = Topology.from_ray({"r1-n2": "quarantined"}, ["r1-n1"])
    group = RayWorkerGroup("cordon")
    try:
        group.reserve(place(layout, topo))
        landed = {r.node_name for r in group.spawn()}
    finally:
        group.shutdown()
    assert landed == {"r2-n1"}
    wait_for_free_gpus(16)


def test_a_gang_that_cannot_be_granted_is_removed_with_the_reason(ray_cluster):
    wait_for_free_gpus(16)
    before = Topology.from_ray()
    blocker = reserve(place(Layout(tp=4, dp=3), before), name="lattice-test-blocker", timeout_s=30)
    try:
        stale = place(DP2_PP2_TP2, before)  # planned on the empty cluster, now mostly taken
        with pytest.raises(ReservationTimeout) as e:
            reserve(stale, name="lattice-test-gang", timeout_s=2)
        assert "not granted within 2s" in str(e.value) and "free now" in str(e.value)
        states = [pg["state"] for pg in placement_group_table().values() if pg["name"] == "lattice-test-gang"]
        assert states == ["REMOVED"]
        assert Topology.from_ray().gpus_free == 4  # nothing of the failed gang is held
    finally:
        release(blocker)
    wait_for_free_gpus(16)


def test_controller_of_a_job_that_does_not_fit_waits_with_the_reason(ray_cluster):
    cfg = RunConfig(model=SPEC, layout=Layout(tp=4, dp=5), steps=2)
    handle = start_controller("too-big", cfg, options=ControllerOptions(poll_interval_s=0.1))
    try:
        snap = poll_until(handle, lambda s: s["state"] == "WAITING", 60)
        assert snap["job_state"] == "queued"
        assert "needs 20 GPUs in groups of 4 within a node" in snap["reason"]
        assert [e for e in snap["events"] if e["kind"] == "placement_failed"]
        assert not [pg for pg in placement_group_table().values()
                    if pg["name"].startswith("lattice-job-too-big") and pg["state"] != "REMOVED"]
        assert ray.get(handle.cancel.remote()) == "CANCELLED"
    finally:
        kill_controller("too-big")


def _direct_train(rank: int, world: int, cfg_dict: dict) -> str:
    import torch

    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return train(ctx, RunConfig.from_dict(cfg_dict), resume=False).model_digest


def test_controller_runs_a_dp2_pp2_tp2_job_end_to_end(ray_cluster, tmp_path):
    wait_for_free_gpus(16)
    ckpt = tmp_path / "ckpt"
    cfg = RunConfig(model=SPEC, layout=DP2_PP2_TP2, steps=6,
                    checkpoint=CheckpointConfig(dir=str(ckpt), every_steps=3))
    handle = start_controller("e2e", cfg, options=ControllerOptions(poll_interval_s=0.2))
    try:
        snap = poll_until(handle, lambda s: s["terminal"], 240)
        assert snap["state"] == "FINISHED", snap["reason"]
        # where the ranks really ran (read back from the actors)
        assert len(snap["placement"]) == 8 and tp_groups_share_a_node(snap["placement"])
        stage_racks = [{r["rack"] for r in snap["placement"] if r["pp"] == s} for s in range(2)]
        assert all(len(racks) == 1 for racks in stage_racks) and stage_racks[0] != stage_racks[1]
        result = snap["result"]
        assert result["final_step"] == 6 and len(result["losses"]) == 6
        assert result["losses"][-1] < result["losses"][0]
        assert list_checkpoints(ckpt)[-1] == 6 and result["checkpoints"][-1]["step"] == 6
        saved = [e["step"] for e in snap["events"] if e["kind"] == "checkpoint_saved"]
        assert saved == [3, 6]
        kinds = [e["kind"] for e in snap["events"]]
        assert kinds.index("placed") < kinds.index("started") < kinds.index("finished")
        assert snap["progress"]["step"] == 6
        assert snap["progress"]["loss"] == pytest.approx(result["losses"][-1])
        # found again by name, as the service does after a restart
        again = get_controller("e2e")
        assert again is not None and ray.get(again.poll.remote(snap["last_seq"]))["events"] == []
    finally:
        kill_controller("e2e")
    wait_for_free_gpus(16)
    # the same computation as the training engine run directly on 8 plain processes
    direct = run_ranks(8, _direct_train, (RunConfig(model=SPEC, layout=DP2_PP2_TP2, steps=6).to_dict(),))
    assert set(direct) == {result["model_digest"]}


REATTACH = """
import json, sys, ray
from workers.cluster import connect
from workers.controller import get_controller
connect(sys.argv[1])
handle = get_controller(sys.argv[2])
print(json.dumps(ray.get(handle.poll.remote(0))["state"] if handle else None))
"""


def test_cancel_tears_down_the_ranks_and_frees_their_gpus(ray_cluster):
    wait_for_free_gpus(16)
    cfg = RunConfig(model=SPEC, layout=Layout(tp=2, dp=2), steps=100_000)
    handle = start_controller("cancel", cfg, options=ControllerOptions(train_fn=STANDIN, poll_interval_s=0.2))
    try:
        poll_until(handle, lambda s: (s["progress"]["step"] or 0) >= 2, 120)
        assert Topology.from_ray().gpus_free == 12
        # a new driver process (the restarted service) re-attaches to the running job by name
        out = subprocess.run([sys.executable, "-c", REATTACH, ray_cluster.address, "cancel"],
                             capture_output=True, text=True, timeout=120, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == "RUNNING"
        assert ray.get(handle.cancel.remote("cancelled by test")) == "CANCELLED"
        snap = ray.get(handle.poll.remote(0))
        assert snap["job_state"] == "cancelled" and snap["reason"] == "cancelled by test"
        wait_for_free_gpus(16)
    finally:
        kill_controller("cancel")


def test_a_killed_rank_is_detected_and_the_job_resumes_from_its_checkpoint(ray_cluster, tmp_path):
    wait_for_free_gpus(16)
    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=4,
                    checkpoint=CheckpointConfig(dir=str(tmp_path / "ckpt"), every_steps=2))
    # fast_path=False: re-place every rank (the fast path would keep the group and refill the slot).
    options = ControllerOptions(poll_interval_s=0.2, fast_path=False,
                                faults=({"kind": "kill_rank", "rank": 1, "at_step": 3},))
    handle = start_controller("killed", cfg, options=options)
    try:
        snap = poll_until(handle, lambda s: s["terminal"], 240)
        assert snap["state"] == "FINISHED", snap["reason"]
        assert snap["restarts"] == 1 and snap["result"]["resumed_from"] == 2
        assert snap["result"]["final_step"] == 4
        failure = next(e for e in snap["events"] if e["kind"] == "failure")["failure"]
        assert failure["kind"] == "rank_died" and failure["ranks"] == [1]
        kinds = [e["kind"] for e in snap["events"]]
        order = [kinds.index(k) for k in ("failure", "node_suspect", "restart", "finished")]
        assert order == sorted(order)
        suspect = failure["nodes"][0]
        assert snap["suspect_nodes"] == [suspect]
        # the restart is placed off the suspect node (it is used last) and read back from the new actors
        assert suspect not in {r["node_name"] for r in snap["placement"]}
    finally:
        kill_controller("killed")
    wait_for_free_gpus(16)
