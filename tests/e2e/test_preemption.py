"""Preemption that loses nothing, through the whole service on the embedded cluster (real Ray, real
training): draining a node sends its jobs a preemption notice; a preemptible job checkpoints at the
next step boundary, goes back to the queue, resumes on another node from that step and ends with
the digest of an uninterrupted run, 0 steps lost; a `preemptible: false` job on the same node is not
touched; the drained node takes no new ranks until uncordoned. A higher-priority job that does not
fit preempts a lower-priority one the same way (LATTICE_PREEMPT_FOR_PRIORITY), and a tenant takes back
the GPUs it lent (LATTICE_RECLAIM_BORROWED)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from service import metrics
from service.auth import create_token
from tests.e2e.conftest import LiveService, make_service, wait_for, wait_for_free_gpus
from tests.faults.harness import service_job_spec

pytestmark = pytest.mark.ray

NODE, OTHERS = "r1-n1", ("r1-n2", "r2-n1", "r2-n2")
STEPS = 12
SPEC = service_job_spec("preempt-e2e", steps=STEPS, every=0, seed=5)  # no periodic checkpoints
SLOW = [{"kind": "slow_rank", "rank": 0, "at_step": 2, "seconds": 0.5}]  # sleeping changes no maths


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    # slow_rank below only slows the jobs down (reported, never restarted off its node)
    service = make_service(ray_cluster, tmp_path_factory.mktemp("preempt") / "home", fault_injection=True,
                           preempt_for_priority=True, controller_defaults={"straggler_action": "report"})
    wait_for(lambda: len(service.api("GET", "/v1/cluster").json()["nodes"]) == 4, 60, "the nodes table")
    try:
        yield service
    finally:
        for node in (NODE, *OTHERS):
            service.api("POST", f"/v1/cluster/nodes/{node}/uncordon")
        service.close()


@pytest.fixture(scope="module")
def baseline(svc: LiveService) -> dict[str, Any]:
    """An uninterrupted run of SPEC."""
    done = svc.wait_state(svc.submit(SPEC)["id"], ("succeeded", "failed", "cancelled"))
    assert done["state"] == "succeeded", done["error"]
    return done


def _nodes(job: dict[str, Any]) -> set[str]:
    return {r["node_name"] for r in job["placement"]}


def _of(svc: LiveService, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [e["payload"] for e in svc.events(job_id) if e["type"] == kind]


def _at(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


def _counter(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name) or 0.0


def _resumed_losslessly(svc: LiveService, job_id: str, baseline: dict[str, Any], why: str) -> dict[str, Any]:
    """The job was preempted once with a checkpoint at the step boundary, resumed from that step and
    ended with the uninterrupted run's digest; returns the finished job."""
    done = svc.wait_state(job_id, ("succeeded", "failed", "cancelled"), timeout_s=120)
    assert done["state"] == "succeeded", done["error"]
    [preempted] = _of(svc, job_id, "preempted")
    at = preempted["restore_step"]
    assert 2 <= at < STEPS and preempted["step"] == at and preempted["steps_lost"] == 0
    assert preempted["graceful"] and why in preempted["reason"]
    requeued = [p for p in _of(svc, job_id, "state") if p.get("preempted")]
    assert [(p["from"], p["to"], p["step"]) for p in requeued] == [("running", "queued", at)]
    assert [p["step"] for p in _of(svc, job_id, "resumed") if p.get("after") == "preemption"] == [at]
    result = done["result"]
    assert result["model_digest"] == baseline["result"]["model_digest"]
    assert result["resumed_from"] == at and len(result["losses"]) == STEPS - at  # 0 steps lost
    return done


def test_drain_checkpoints_requeues_and_resumes_elsewhere_with_the_uninterrupted_digest(
        svc: LiveService, baseline: dict[str, Any]) -> None:
    before = (_counter("lattice_preemptions_total"), _counter("lattice_steps_lost_to_preemption_total"))

    # Both jobs land on NODE (the others are cordoned), slowed (sleeping changes no maths).
    for node in OTHERS:
        assert svc.api("POST", f"/v1/cluster/nodes/{node}/cordon").status_code == 200
    mover = svc.submit({**SPEC, "faults": SLOW})
    pinned = svc.submit({**service_job_spec("pinned", steps=8, every=0, seed=6), "faults": SLOW,
                         "preemption": {"preemptible": False}})
    for j in (mover, pinned):
        wait_for(lambda j=j: (svc.job(j["id"])["progress"]["step"] or 0) >= 2, 120, "both jobs to train")
    assert _nodes(svc.job(mover["id"])) == _nodes(svc.job(pinned["id"])) == {NODE}
    for node in OTHERS:
        assert svc.api("POST", f"/v1/cluster/nodes/{node}/uncordon").status_code == 200

    assert svc.api("POST", f"/v1/cluster/nodes/{NODE}/drain", token=svc.user).status_code == 403
    drained = svc.api("POST", f"/v1/cluster/nodes/{NODE}/drain")
    assert drained.status_code == 200 and drained.json()["cordoned"], drained.text

    done = _resumed_losslessly(svc, mover["id"], baseline, f"node {NODE} drains")
    assert NODE not in _nodes(done)  # the drained node took no new ranks

    finished = svc.wait_state(pinned["id"], ("succeeded", "failed", "cancelled"), timeout_s=60)
    assert finished["state"] == "succeeded" and _nodes(finished) == {NODE}
    assert not _of(svc, pinned["id"], "preemption_requested") and not _of(svc, pinned["id"], "preempted")
    after = (_counter("lattice_preemptions_total"), _counter("lattice_steps_lost_to_preemption_total"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 0)
    assert svc.api("POST", f"/v1/cluster/nodes/{NODE}/uncordon").json()["schedulable"]
    wait_for_free_gpus()


def test_a_higher_priority_job_that_does_not_fit_preempts_a_lower_one_losslessly(
        svc: LiveService, baseline: dict[str, Any]) -> None:
    for node in OTHERS:  # NODE's 4 GPUs only: the low job holds 2, the high one needs 4
        assert svc.api("POST", f"/v1/cluster/nodes/{node}/cordon").status_code == 200
    try:
        low = svc.submit({**SPEC, "faults": [{**SLOW[0], "seconds": 1.0}]})  # still training when high comes
        wait_for(lambda: (svc.job(low["id"])["progress"]["step"] or 0) >= 2, 120, "the low job to train")
        high = svc.submit({**service_job_spec("high", steps=3, every=0, seed=7, dp=4), "priority": 5})
        first = svc.wait_state(high["id"], ("succeeded", "failed", "cancelled"), timeout_s=120)
        assert first["state"] == "succeeded", first["error"]
        notices = _of(svc, low["id"], "preemption_requested")
        assert [high["id"] in p["reason"] for p in notices] == [True], notices
        _resumed_losslessly(svc, low["id"], baseline, f"for job {high['id']}")
        # the high job ran while the low one waited in the queue, then the low one went on
        starts = [e["time"] for e in svc.events(low["id"])
                  if e["type"] == "state" and e["payload"]["to"] == "starting"]
        assert len(starts) == 2 and _at(starts[-1]) >= _at(first["finished_at"])
    finally:
        for node in OTHERS:
            svc.api("POST", f"/v1/cluster/nodes/{node}/uncordon")
    wait_for_free_gpus()


def test_an_owner_takes_back_the_gpus_it_lent_and_the_borrower_resumes_losslessly(
        svc: LiveService, baseline: dict[str, Any]) -> None:
    """Tenant `lender` (quota 0, borrowing) runs on NODE's idle GPUs; team-a (quota 4) submits a 4-GPU
    job of the same priority: the borrower is preempted (LATTICE_RECLAIM_BORROWED, on by default),
    team-a's job runs, then the borrower resumes and finishes with 0 steps lost."""
    with svc.session() as s:
        borrower = create_token(s, tenant="lender", admin=True)  # an admin: its spec may slow a rank
        capped = create_token(s, tenant="capped")
        s.commit()
    for node in OTHERS:  # NODE's 4 GPUs only
        assert svc.api("POST", f"/v1/cluster/nodes/{node}/cordon").status_code == 200
    tenants = (("lender", {"gpu_quota": 0, "borrowing": True}), ("team-a", {"gpu_quota": 4}),
               ("capped", {"gpu_quota": 2}))
    try:
        for tenant, doc in tenants:
            assert svc.api("PUT", f"/v1/tenants/{tenant}", json=doc).status_code == 200
        # a job beyond its tenant's quota (and no borrowing) waits with the reason, on free GPUs
        over_spec = service_job_spec("over", steps=3, every=0, seed=7, dp=4)
        over = svc.api("POST", "/v1/jobs", token=capped, json=over_spec)
        assert over.status_code == 201, over.text
        over_id = over.json()["id"]
        wait_for(lambda: any(p["reason"].startswith("quota: needs 4 GPUs, the quota is 2")
                             for p in _of(svc, over_id, "waiting")), 60, "the quota reason")
        assert svc.job(over_id)["state"] == "queued"
        assert svc.api("POST", f"/v1/jobs/{over_id}/cancel").status_code == 200
        slowed = {**SPEC, "faults": [{**SLOW[0], "seconds": 1.0}]}  # still training when the owner comes
        r = svc.api("POST", "/v1/jobs", token=borrower, json=slowed)
        assert r.status_code == 201, r.text
        lent = r.json()
        wait_for(lambda: (svc.job(lent["id"])["progress"]["step"] or 0) >= 2, 120, "the borrower to train")
        r = svc.api("POST", "/v1/jobs", token=svc.user,
                    json=service_job_spec("owner", steps=3, every=0, seed=7, dp=4))
        assert r.status_code == 201, r.text
        first = svc.wait_state(r.json()["id"], ("succeeded", "failed", "cancelled"), timeout_s=120)
        assert first["state"] == "succeeded", first["error"]
        why = "reclaim: tenant team-a takes back 2 GPUs lent to tenant lender"
        assert [p["reason"] for p in _of(svc, lent["id"], "preemption_requested")] == [why]
        _resumed_losslessly(svc, lent["id"], baseline, why)
    finally:
        for tenant, _ in tenants:  # omitted fields keep their values: reset them by name
            svc.api("PUT", f"/v1/tenants/{tenant}", json={"gpu_quota": None, "borrowing": False})
        for node in OTHERS:
            svc.api("POST", f"/v1/cluster/nodes/{node}/uncordon")
    wait_for_free_gpus()
