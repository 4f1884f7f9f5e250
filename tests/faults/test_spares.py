"""Hot spares (workers.spares): the pool's choices against a fake backend, then real Ray: a spare lands
only on a usable node and is dropped from one that becomes unusable, a used spare is replaced, and a
job that loses a rank continues on the spare (TP = 2: inside the TP group's node) with the fault-free
run's weights."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest

from tests.faults.harness import assert_succeeded_like_fault_free, events, job_cfg, options, run_job
from training.config.layout import Layout
from workers.spares import SparePool, choose_spare, fill_targets, unusable_nodes
from workers.topology import NodeInfo, Topology

# ---- the choices, against a fake backend ------------------------------------------------------------


class FakeActor:
    def __init__(self, node: NodeInfo, pid: int) -> None:
        self.node, self.pid, self.killed = node, pid, False


class FakeBackend:
    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.created: list[FakeActor] = []

    def nodes(self) -> list[NodeInfo]:
        return list(self.topology.gpu_nodes)

    def create(self, node: NodeInfo) -> FakeActor:
        actor = FakeActor(node, 1000 + len(self.created))
        self.created.append(actor)
        return actor

    def ready(self, handle: FakeActor, timeout_s: float) -> dict[str, Any]:
        n = handle.node
        return {"node_id": n.node_id, "node_name": n.name, "rack": n.rack, "pid": handle.pid}

    def kill(self, handle: FakeActor) -> None:
        handle.killed = True


def _topology(**kw: Any) -> Topology:
    return Topology.uniform(racks=2, nodes_per_rack=2, gpus_per_node=4, **kw)


def test_spares_go_only_to_usable_nodes_spread_off_the_job_and_in_its_rack_first() -> None:
    topo = _topology(health={"r2-n1": "quarantined"}, cordoned=["r2-n2"], used={"r1-n2": 4})
    assert fill_targets(topo.gpu_nodes, 3, avoid_nodes={"r1-n1"}, prefer_rack="r1") == [
        topo.node("r1-n1")] * 3  # the only usable node with free GPUs, even if the job is on it
    topo = _topology(health={"r2-n1": "quarantined"})
    names = [n.name for n in fill_targets(topo.gpu_nodes, 3, avoid_nodes={"r1-n1"}, prefer_rack="r2")]
    assert names == ["r2-n2", "r1-n2", "r2-n2"]  # off the job's node, one per node first, its rack first
    # A TP job prefers its own nodes: only a spare there can join a TP group.
    assert [n.name for n in fill_targets(topo.gpu_nodes, 1, prefer_nodes={"r2-n2"})] == ["r2-n2"]
    assert fill_targets(topo.gpu_nodes, 2, exclude={"r1-n1", "r1-n2", "r2-n2"}) == []


def test_a_rank_with_tp_peers_takes_only_a_spare_on_their_node() -> None:
    topo = _topology()
    pool = SparePool("j", 2, FakeBackend(topo))
    pool.fill(prefer_nodes={"r1-n2", "r2-n1"})
    pool.wait_ready()
    assert sorted(s["node"] for s in pool.describe()) == ["r1-n2", "r2-n1"]
    assert pool.take(node="r1-n1", rack="r1", tp_node="r1-n1") is None  # TP stays in a node: fall back
    got = pool.take(node="r2-n1", rack="r2", tp_node="r2-n1")
    assert got is not None and got.node.name == "r2-n1"
    assert [s["node"] for s in pool.describe()] == ["r1-n2"]


def test_a_rank_without_tp_peers_prefers_a_warm_spare_in_its_rack() -> None:
    topo = _topology()
    backend = FakeBackend(topo)
    pool = SparePool("j", 2, backend)
    pool.fill(prefer_nodes={"r1-n2", "r2-n2"})
    assert {s["state"] for s in pool.describe()} == {"starting"}
    pool.wait_ready()
    got = pool.take(node="r2-n1", rack="r2")
    assert got is not None and got.node.rack == "r2"
    assert choose_spare([], node="r1-n1", rack="r1") is None


def test_spares_on_nodes_that_become_unusable_are_dropped_and_never_handed_out() -> None:
    topo = _topology()
    backend = FakeBackend(topo)
    bad: set[str] = set()
    pool = SparePool("j", 2, backend, bad_nodes=lambda: bad)
    pool.fill(avoid_nodes={"r1-n1"}, prefer_rack="r1")
    pool.wait_ready()
    on = sorted(s["node"] for s in pool.describe())
    bad.update(unusable_nodes({on[0]: "quarantined"}, cordoned=[on[1]]))
    assert pool.take(node="r1-n1", rack="r1") is None
    assert len(pool) == 0 and all(a.killed for a in backend.created)
    pool.fill(avoid_nodes={"r1-n1"})  # refilled elsewhere
    assert len(pool) == 2 and not {s["node"] for s in pool.describe()} & set(on)
    pool.shutdown()
    assert len(pool) == 0 and all(a.killed for a in backend.created)
    assert pool.take(node="r1-n1") is None


def test_refill_tops_the_pool_up_in_the_background() -> None:
    backend = FakeBackend(_topology())
    pool = SparePool("j", 1, backend)
    pool.fill()
    assert pool.take(node="r1-n1", rack="r1") is not None and len(pool) == 0
    pool.refill()
    deadline = time.monotonic() + 10
    while not (len(pool) == 1 and pool.describe()[0]["state"] == "warm"):
        assert time.monotonic() < deadline, pool.describe()
        time.sleep(0.02)
    assert len(backend.created) == 2


# ---- real Ray ---------------------------------------------------------------------------------------


@pytest.fixture
def free_cluster(ray_cluster: Any) -> None:
    from tests.faults.harness import wait_for_free_gpus

    wait_for_free_gpus(16)


def _ray_pool(size: int, bad: set[str]) -> SparePool:
    from workers.spares import RaySpareBackend
    from workers.worker_group import RemoteRankActor

    backend = RaySpareBackend(RemoteRankActor, "spares-ray")
    return SparePool("spares-ray", size, backend, bad_nodes=lambda: bad)


def _engine_imported(actor: Any) -> bool:
    import sys

    return "training.train" in sys.modules and "torch.distributed.checkpoint" in sys.modules


@pytest.mark.ray
def test_real_spares_avoid_unusable_nodes_and_a_used_one_is_replaced(free_cluster: Any) -> None:
    names = [n.name for n in Topology.from_ray(include_dead=False).gpu_nodes]
    bad = set(unusable_nodes({names[0]: "quarantined"}, cordoned=[names[1]]))
    pool = _ray_pool(2, bad)
    try:
        pool.fill()
        pool.wait_ready()
        spares = pool.describe()
        assert len(spares) == 2 and {s["state"] for s in spares} == {"warm"}
        assert not {s["node"] for s in spares} & bad
        first = pool.take(node=spares[0]["node"], rack=spares[0]["rack"])
        assert first is not None
        import ray

        assert ray.get(first.__ray_call__.remote(_engine_imported), timeout=30)  # warm = imports done

        pid = ray.get(first.where.remote(), timeout=30)["pid"]
        ray.get(first.assign.remote(3, 4, {"pp": 0, "dp": 3, "cp": 0, "tp": 0}), timeout=30)
        assert ray.get(first.where.remote(), timeout=30)["rank"] == 3
        pool.refill()
        deadline = time.monotonic() + 60
        while not (len(pool) == 2 and {s["state"] for s in pool.describe()} == {"warm"}):
            assert time.monotonic() < deadline, pool.describe()
            time.sleep(0.2)
        assert pid not in {s["pid"] for s in pool.describe()}
        # A node that becomes unusable loses its spares.
        bad.add(pool.describe()[0]["node"])
        assert pool.prune() >= 1 and not {s["node"] for s in pool.describe()} & bad
        ray.kill(first, no_restart=True)
    finally:
        pool.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("layout", [pytest.param(Layout(dp=2), id="dp2"),
                                    pytest.param(Layout(tp=2), id="tp2"),
                                    pytest.param(Layout(tp=2, dp=2), id="tp2dp2", marks=pytest.mark.slow)])
def test_a_killed_rank_is_replaced_by_the_warm_spare(free_cluster: Any, tmp_path: Any,
                                                     layout: Layout) -> None:
    cfg = job_cfg(str(tmp_path / "ckpt"), layout=layout)
    opts = replace(options({"kind": "kill_rank", "rank": 1, "at_step": 3}), spares=1)
    snap = run_job(f"spares-tp{layout.tp}-dp{layout.dp}", cfg, opts)
    assert_succeeded_like_fault_free(snap, cfg)
    restart = events(snap, "restart")[0]
    assert restart["replaced"] == [1] and restart["replacement_s"] is not None
    # The spare is used unless it cannot join the TP group (with TP 2 x DP 2 it may sit on another node).
    assert restart["spare_used"] is True or layout.dp == 2 and layout.tp == 2
    lost = next(r for r in restart["placement"] if r["rank"] == 1)
    coord = (lost["pp"], lost["dp"], lost["cp"])
    group = [r for r in restart["placement"] if (r["pp"], r["dp"], r["cp"]) == coord]
    assert len(group) == layout.tp and len({r["node_name"] for r in group}) == 1  # TP stays in one node
    assert snap["spares"] == []  # the pool went with the job
