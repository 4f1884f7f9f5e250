"""GET /v1/cluster and the admin cordon routes; capacity, priority and cancel through the scheduler.

The ranks here run a stand-in train function (a real gloo all-reduce per step, no model) so that
a job can be held busy cheaply; placement, reservation, cancel and the store are all real."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from tests.e2e.conftest import LiveService, make_service, wait_for, wait_for_free_gpus

pytestmark = pytest.mark.ray

STANDIN = "tests.workers.standin:allreduce_train"
NODES = ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]


def spec(name: str, steps: int, priority: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "priority": priority,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16},
        "train": {"steps": steps, "global_batch": 2},
        "parallelism": {"tp": 2, "dp": 2},
    }


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    # Without priority preemption (tests/e2e/test_preemption.py has it): a higher priority waits, first.
    service = make_service(ray_cluster, tmp_path_factory.mktemp("capacity") / "home",
                           preempt_for_priority=False, controller_defaults={"train_fn": STANDIN})
    wait_for(lambda: len(service.api("GET", "/v1/cluster").json()["nodes"]) == 4, 60, "the nodes table")
    try:
        yield service
    finally:
        for node in NODES:
            service.api("POST", f"/v1/cluster/nodes/{node}/uncordon")
        service.close()


def test_cluster_shows_racks_nodes_gpus_and_health(svc: LiveService) -> None:
    r = svc.api("GET", "/v1/cluster", token=svc.user)  # any tenant may look
    assert r.status_code == 200
    c = r.json()
    assert c["source"] == "live" and c["gpu_type"] == "cpu-virtual"
    assert [(rack["name"], rack["nodes"], rack["gpus_total"]) for rack in c["racks"]] == [
        ("r1", ["r1-n1", "r1-n2"], 8), ("r2", ["r2-n1", "r2-n2"], 8),
    ]
    assert (c["gpus_total"], c["gpus_free"], c["gpus_schedulable"]) == (16, 16, 16)
    assert c["links"]["inter_rack_gbps"] < c["links"]["inter_node_gbps"] < c["links"]["intra_node_gbps"]
    for n in c["nodes"]:
        assert (n["gpus_total"], n["gpus_free"], n["health"], n["cordoned"]) == (4, 4, "ready", False)
        assert n["alive"] and n["schedulable"] and n["ray_node_id"]
    assert svc.client is not None and svc.client.get("/v1/cluster").status_code == 401


def test_cordon_is_admin_only_and_names_the_node(svc: LiveService) -> None:
    r = svc.api("POST", "/v1/cluster/nodes/r2-n2/cordon", token=svc.user)
    assert r.status_code == 403
    assert svc.api("POST", "/v1/cluster/nodes/nope/cordon").status_code == 404
    nodes = svc.api("GET", "/v1/cluster").json()["nodes"]
    ray_id = next(n["ray_node_id"] for n in nodes if n["id"] == "r2-n2")
    r = svc.api("POST", f"/v1/cluster/nodes/{ray_id}/cordon")  # a Ray node id works too
    assert r.status_code == 200 and r.json()["id"] == "r2-n2" and r.json()["cordoned"]
    assert not r.json()["schedulable"] and r.json()["health"] == "ready"
    wait_for(lambda: svc.api("GET", "/v1/cluster").json()["gpus_schedulable"] == 12, 30, "the cordon to show")
    r = svc.api("POST", "/v1/cluster/nodes/r2-n2/uncordon")
    assert r.status_code == 200 and not r.json()["cordoned"] and r.json()["schedulable"]


def test_capacity_priority_cancel_and_cordoned_nodes(svc: LiveService) -> None:
    # Only r1-n1 (4 GPUs) may receive ranks: every job below needs all four.
    for node in ("r1-n2", "r2-n1", "r2-n2"):
        assert svc.api("POST", f"/v1/cluster/nodes/{node}/cordon").status_code == 200
    busy = svc.submit(spec("busy", steps=100_000))
    wait_for(lambda: svc.job(busy["id"])["progress"]["step"] >= 2, 180, "the busy job to train")
    low = svc.submit(spec("low", steps=3, priority=0))
    high = svc.submit(spec("high", steps=3, priority=5))
    for j in (low, high):
        wait_for(lambda j=j: any(e["type"] == "waiting" for e in svc.events(j["id"])), 60, "a waiting reason")
    assert svc.job(low["id"])["state"] == svc.job(high["id"])["state"] == "queued"

    cancelled = svc.api("POST", f"/v1/jobs/{busy['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    done = {j["id"]: svc.wait_state(j["id"], ("succeeded", "failed", "cancelled")) for j in (low, high)}
    b, lo, hi = svc.job(busy["id"]), done[low["id"]], done[high["id"]]
    assert lo["state"] == hi["state"] == "succeeded"
    # the cancelled job's GPUs went to the higher priority job first; the two never overlapped
    busy_end = datetime.fromisoformat(b["finished_at"])
    hi_start, hi_end = datetime.fromisoformat(hi["started_at"]), datetime.fromisoformat(hi["finished_at"])
    assert busy_end <= hi_start < hi_end <= datetime.fromisoformat(lo["started_at"])
    for j in (b, lo, hi):
        assert {r["node_name"] for r in j["placement"]} == {"r1-n1"}  # cordoned nodes got no ranks
    events = svc.events(low["id"])
    reasons = [e["payload"]["reason"] for e in events if e["type"] == "waiting"]
    assert reasons and all(a != b for a, b in zip(reasons, reasons[1:], strict=False))  # once per reason
    assert "cordoned" in reasons[0] and "needs 4 GPUs" in reasons[0]
    busy_events = [e["type"] for e in svc.events(busy["id"])]
    assert "cancelled" in busy_events  # the controller tore the ranks down after the store said so
    wait_for_free_gpus()
