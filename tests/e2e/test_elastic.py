"""Growing back, through the whole service on the embedded cluster (real Ray, real training): an elastic
job at DP 4 loses every rank on its cordoned node (as with the node's loss: the lost ranks fit nowhere
else, so the fast path cannot move them), cannot be placed at DP 4 again and shrinks to DP 2 (the
global batch kept: 2 micro-batches); the node is uncordoned, the controller sees the capacity, checkpoints
at the next step boundary, replans up to DP 4 and the job succeeds. The losses after growing back and
the final weights match a fault-free run's (allclose 1e-4: the global batch and so the maths are kept)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.e2e.conftest import LiveService, make_service, wait_for, wait_for_free_gpus
from tests.faults.harness import checkpoint_params, service_job_spec
from training.config.layout import Layout
from workers.placement import place, release, reserve
from workers.topology import Topology

pytestmark = pytest.mark.ray

HOME, SPARE, OTHERS = "r1-n1", "r1-n2", ("r2-n1", "r2-n2")
STEPS = 40
SPEC = service_job_spec("elastic", steps=STEPS, every=2, seed=11, dp=4)
SLOW = {"kind": "slow_rank", "rank": 0, "at_step": 1, "seconds": 0.5}  # sleeping changes no maths


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    service = make_service(ray_cluster, tmp_path_factory.mktemp("elastic") / "home", fault_injection=True,
                           controller_defaults={"straggler_action": "report"})
    wait_for(lambda: len(service.api("GET", "/v1/cluster").json()["nodes"]) == 4, 60, "the nodes table")
    try:
        yield service
    finally:
        for node in (HOME, SPARE, *OTHERS):
            service.api("POST", f"/v1/cluster/nodes/{node}/uncordon")
        service.close()


def _cordon(svc: LiveService, *nodes: str, on: bool = True) -> None:
    for node in nodes:
        r = svc.api("POST", f"/v1/cluster/nodes/{node}/{'cordon' if on else 'uncordon'}")
        assert r.status_code == 200, r.text


def _of(svc: LiveService, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in svc.events(job_id) if e["type"] == kind]


def _step(svc: LiveService, job_id: str) -> int:
    return svc.job(job_id)["progress"]["step"] or 0


def _final_params(svc: LiveService, job: dict[str, Any], out: Any) -> dict[str, Any]:
    root = svc.settings.checkpoint_root
    assert root is not None
    return checkpoint_params(root / job["id"] / f"step-{STEPS}", out)


def test_a_shrunk_job_grows_back_when_its_node_is_uncordoned(svc: LiveService, tmp_path: Any) -> None:
    baseline = svc.wait_state(svc.submit(SPEC)["id"], ("succeeded", "failed", "cancelled"))
    assert baseline["state"] == "succeeded", baseline["error"]
    wait_for_free_gpus()

    # SPARE keeps 2 free GPUs (a blocker holds the others); the job starts on HOME's 4.
    _cordon(svc, SPARE, *OTHERS)
    blocker = reserve(place(Layout(dp=2), Topology.from_ray(cordoned=[HOME, *OTHERS])),
                      name="elastic-blocker", timeout_s=30)
    try:
        job = svc.submit({**SPEC, "faults": [SLOW],
                          "fault_tolerance": {"elastic": True, "min_gpus": 2}})
        jid = job["id"]
        wait_for(lambda: _step(svc, jid) >= 2, 180, "the job to train at DP 4")
        assert {r["node_name"] for r in svc.job(jid)["placement"]} == {HOME}

        # HOME is cordoned and its ranks die: DP 4 fits nowhere now, DP 2 fits on SPARE.
        _cordon(svc, SPARE, on=False)
        _cordon(svc, HOME)
        time.sleep(1.5)  # the next scheduler ticks hand the cordon to the controller
        at = _step(svc, jid) + 2
        slow_dp2 = {"kind": "slow_rank", "rank": 1, "at_step": at + 1, "seconds": 1.0}  # fires at DP 2
        kills = [{"kind": "kill_rank", "rank": r, "at_step": at} for r in range(4)]
        for fault in (*kills, slow_dp2):
            r = svc.api("POST", f"/v1/jobs/{jid}/faults", json=fault)
            assert r.status_code == 202, r.text
        shrunk = wait_for(lambda: _of(svc, jid, "replanned"), 180, "the shrink")[0]
        assert shrunk["diff"] == {"dp": [4, 2], "num_microbatches": [1, 2]} and shrunk["global_batch_kept"]
        assert not shrunk.get("grew")
        wait_for(lambda: svc.job(jid)["state"] == "running" and _step(svc, jid) >= at + 2, 180,
                 "the job to train at DP 2")
        assert {r["node_name"] for r in svc.job(jid)["placement"]} == {SPARE}

        _cordon(svc, HOME, on=False)  # capacity returns
        done = svc.wait_state(jid, ("succeeded", "failed", "cancelled"), timeout_s=300)
    finally:
        release(blocker)
    assert done["state"] == "succeeded", done["error"]
    first, grown = _of(svc, jid, "replanned")
    assert grown["grew"] is True and grown["global_batch_kept"]
    assert grown["diff"] == {"dp": [2, 4], "num_microbatches": [2, 1]}
    assert grown["restore_step"] == grown["step"] > first.get("step", 0)
    assert Layout.from_dict(done["plan"]["layout"]) == Layout(dp=4)

    # The same global batch throughout: the losses after growing back and the final weights are the
    # fault-free run's.
    result, ref = done["result"], baseline["result"]
    assert result["resumed_from"] == grown["restore_step"]
    tail = ref["losses"][result["resumed_from"]:]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(tail), atol=1e-4, rtol=1e-4)
    final = _final_params(svc, done, tmp_path / "final.pt")
    clean = _final_params(svc, baseline, tmp_path / "clean.pt")
    assert final.keys() == clean.keys()
    for name, value in clean.items():
        torch.testing.assert_close(final[name], value, atol=1e-4, rtol=1e-4)
    wait_for_free_gpus()
