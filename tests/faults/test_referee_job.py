"""A persistent bit flip on one of two replicas (issue 6), through a real controller and rank
actors on the shared Ray cluster: the re-run from the pre-step snapshot reproduces it, so two
replicas cannot tell which is wrong; a spare on a third, healthy node replays the step, names the
replica it disagrees with, and only that replica's node is quarantined. The job then finishes
with the fault-free run's weights."""

from __future__ import annotations

import pytest

from tests.faults.harness import (
    assert_in_order,
    assert_kept_off,
    assert_succeeded_like_fault_free,
    events,
    job_cfg,
    options,
    run_job,
    wait_for_free_gpus,
)

pytestmark = pytest.mark.ray


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


def test_persistent_flip_with_two_replicas_is_settled_by_a_spare(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    flip = {"kind": "bitflip", "rank": 1, "at_step": 3, "target": "param", "bit": 30, "index": 7,
            "persistent": True}
    snap = run_job("ft-referee", cfg, options(flip))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "integrity_error", "failure", "referee_started", "referee",
                           "attributed", "node_quarantined", "restart", "restore", "resumed", "finished"])
    integrity = events(snap, "integrity_error")[0]
    assert sorted(integrity["ranks"]) == [0, 1] and integrity["evidence"]["transient"] is False
    started, referee = events(snap, "referee_started")[0], events(snap, "referee")[0]["referee"]
    assert referee["culprits"] == [1] and referee["healthy"] == [0]
    assert referee["fingerprint"] == referee["fingerprints"]["0"] != referee["fingerprints"]["1"]
    assert referee["node"] not in started["suspects"]  # the spare ran outside both replicas' nodes
    attributed = events(snap, "attributed")[0]
    assert attributed["ranks"] == [1]
    node = attributed["nodes"][0]
    assert snap["quarantined_nodes"] == [node]  # the healthy replica's node is not punished
    assert_kept_off(snap, node, "node_quarantined")
