"""Resume through the whole service: a job cancelled after its step-12 checkpoint is resumed
(POST /v1/jobs/{id}/resume), restores that checkpoint, trains only the steps after it, and ends
with the same model digest as an uninterrupted run of the same spec."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import LiveService, make_service, wait_for, wait_for_free_gpus
from tests.faults.harness import service_job_spec

pytestmark = pytest.mark.ray

STEPS, EVERY, CANCEL_AFTER = 16, 4, 12


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    # the slowed rank below is only reported as a straggler, never restarted off its node
    service = make_service(ray_cluster, tmp_path_factory.mktemp("resume") / "home", fault_injection=True,
                           controller_defaults={"straggler_action": "report"})
    try:
        yield service
    finally:
        service.close()


def _verified_checkpoint(svc: LiveService, job_id: str, step: int) -> bool:
    return any(e["type"] == "checkpoint" and e["payload"].get("step") == step and e["payload"].get("verified")
               for e in svc.events(job_id))


def _resume(svc: LiveService, job_id: str) -> dict[str, Any]:
    """Resume; a 409 while the cancelled job's ranks are still stopping is retried."""
    def attempt() -> dict[str, Any] | None:
        r = svc.api("POST", f"/v1/jobs/{job_id}/resume")
        if r.status_code == 409 and "still stopping" in r.json()["detail"]:
            time.sleep(0.5)
            return None
        assert r.status_code == 200, r.text
        return dict(r.json())
    return wait_for(attempt, 60, f"job {job_id} to accept the resume")


def test_cancelled_job_resumes_from_its_checkpoint_with_the_fault_free_digest(svc: LiveService) -> None:
    spec = service_job_spec("resume-e2e", steps=STEPS, every=EVERY, seed=3)
    baseline = svc.wait_state(svc.submit(spec)["id"], ("succeeded", "failed", "cancelled"))
    assert baseline["state"] == "succeeded", baseline["error"]

    # the same spec, slowed (a straggler sleeps 2 s a step) from step 12 on so that it is cancelled
    # after its step-12 checkpoint is verified and before it finishes; sleeping changes no maths
    slowed = {**spec, "faults": [{"kind": "slow_rank", "rank": 0, "at_step": CANCEL_AFTER, "seconds": 2.0}]}
    job_id = svc.submit(slowed)["id"]
    wait_for(lambda: _verified_checkpoint(svc, job_id, CANCEL_AFTER), 240, "the step-12 checkpoint")
    cancelled = svc.api("POST", f"/v1/jobs/{job_id}/cancel").json()
    assert cancelled["state"] == "cancelled"
    stopped_at = cancelled["progress"]["step"]
    assert CANCEL_AFTER <= stopped_at < STEPS

    resumed = _resume(svc, job_id)
    assert (resumed["state"], resumed["attempt"]) == ("queued", cancelled["attempt"] + 1)
    assert resumed["progress"]["step"] >= CANCEL_AFTER  # counted from the checkpoint, not from 0
    checkpoint_step = resumed["progress"]["step"]
    assert checkpoint_step % EVERY == 0 and checkpoint_step <= stopped_at

    done = svc.wait_state(job_id, ("succeeded", "failed", "cancelled"))
    assert done["state"] == "succeeded", done["error"]
    result = done["result"]
    assert result["model_digest"] == baseline["result"]["model_digest"]
    assert result["resumed_from"] == checkpoint_step
    # only the steps after the checkpoint were trained again, and the job ends at its last step
    assert len(result["losses"]) == STEPS - checkpoint_step
    assert result["loss_first_step"] == checkpoint_step + 1
    assert result["final_step"] == done["progress"]["step"] == done["progress"]["total_steps"] == STEPS
    assert done["attempt"] == resumed["attempt"]
    types = [e["type"] for e in svc.events(job_id)]
    assert types.count("resume_requested") == 1
