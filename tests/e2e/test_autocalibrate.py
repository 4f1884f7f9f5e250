"""The scheduler calibrates the cluster's node type in the background on the real session cluster: the
quick grid as a Ray task on one of its nodes, and the collectives between one rank on each of two of its
nodes (the inter-node tier, gloo between Ray actors); stored as version 1 and shown by GET /v1/cluster,
once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from service.store.profiles import newest_profile
from tests.e2e.conftest import LiveService, wait_for
from training.calibration.measure import COLLECTIVES


def test_the_scheduler_calibrates_a_node_type_without_a_profile_once(
    service_factory: Callable[..., LiveService],
) -> None:
    svc = service_factory(auto_calibrate=True)

    def shown() -> list[dict[str, Any]]:
        r = svc.api("GET", "/v1/cluster")
        assert r.status_code == 200, r.text
        return r.json()["profiles"]

    # ~20-35 s alone; a bound that holds on a loaded CI host too (it returns as soon as it is there)
    (profile,) = wait_for(shown, 300, "the background calibration's profile in GET /v1/cluster")
    assert (profile["node_type"], profile["version"], profile["backend"]) == ("cpu-virtual", 1, "gloo")
    assert profile["matmul_tflops"]["fp32"] > 0 and profile["all_reduce"]["gbps"] > 0
    assert profile["inter_node_all_reduce"]["gbps"] > 0 and profile["inter_node_all_reduce"]["latency_us"] > 0
    assert svc.runtime is not None and svc.runtime.scheduler is not None
    calibrator = svc.runtime.scheduler.calibrator
    assert calibrator.wait(30) and calibrator.in_flight() == []
    assert calibrator.tick(svc.runtime.scheduler.cluster_view()[0]) == []  # it has a profile now
    with svc.session() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 1 and stored.meta.get("device") == "cpu"
    assert sorted(stored.inter_node) == sorted(COLLECTIVES)
    assert stored.meta["background_s"] > stored.meta["inter_node_s"] > 0
    for kind, points in stored.inter_node.items():
        assert [b for b, _ in points] == [4 << 10, 256 << 10, 4 << 20], kind
        assert all(t > 0 for _, t in points), kind
