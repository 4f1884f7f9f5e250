"""POST /v1/jobs/{id}/resume: a failed or cancelled job goes back to the queue as a new attempt from
its last verified checkpoint; anything else is refused and changes nothing."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler.ingest import attempts
from service.store.models import JobState
from tests.api.conftest import bearer
from tests.api.specs import tiny


class Scheduler:
    """The scheduler seam: records wakes; `attached` are jobs whose controller it still holds."""

    def __init__(self, attached: tuple[str, ...] = ()) -> None:
        self.calls: list[str] = []
        self.attached = list(attached)

    def wake(self) -> None:
        self.calls.append("wake")

    def cancel(self, job_id: str) -> None:
        self.calls.append(f"cancel {job_id}")

    def attached_jobs(self) -> list[str]:
        return list(self.attached)


def _submit(client: TestClient, token: str) -> str:
    r = client.post("/v1/jobs", json=tiny(), headers=bearer(token))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _run_to(sf: sessionmaker[Session], job_id: str, final: JobState, *, step: int = 0,
            checkpoints: dict[int, bool] | None = None) -> None:
    """Walk the job through queued, starting, running (at `step`, with these checkpoints) to `final`."""
    with store.session_scope(sf) as s:
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING):
            store.transition(s, job_id, state)
        store.update_progress(s, job_id, step=step)
        for ckpt_step, verified in (checkpoints or {}).items():
            store.record_checkpoint(s, job_id, ckpt_step, f"/ckpt/{ckpt_step}", verified=verified)
        store.transition(s, job_id, final, reason="rank 0 raised" if final == JobState.FAILED else None,
                         set_fields={"result": {"digest": "x"}} if final == JobState.SUCCEEDED else None)


def _snapshot(sf: sessionmaker[Session], job_id: str) -> dict[str, Any]:
    with sf() as s:
        job = store.get_job(s, job_id)
        return {"state": job.state, "version": job.version, "attempt": job.attempt, "step": job.step,
                "events": len(store.list_events(s, job_id, limit=None))}


def test_resume_cancelled_job_from_its_last_verified_checkpoint(
    app: FastAPI, client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    app.state.scheduler = scheduler = Scheduler()
    job_id = _submit(client, tokens["a"])
    # step 8 verified, step 12 written but not verified: the resume restores 8
    _run_to(db_session_factory, job_id, JobState.CANCELLED, step=13,
            checkpoints={4: True, 8: True, 12: False})
    scheduler.calls.clear()
    r = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["a"]))
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["state"], job["attempt"], job["progress"]["step"]) == ("queued", 1, 8)
    assert job["finished_at"] is None and "step 8" in job["reason"]
    assert scheduler.calls == ["wake"]
    events = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000},
                        headers=bearer(tokens["a"])).json()["items"]
    state_event, resume_event = events[-2], events[-1]
    assert state_event["type"] == "state"
    assert (state_event["payload"]["from"], state_event["payload"]["to"]) == ("cancelled", "queued")
    assert resume_event["type"] == store.RESUME_EVENT
    assert {k: resume_event["payload"][k] for k in ("from_state", "checkpoint_step", "step", "attempt")} == {
        "from_state": "cancelled", "checkpoint_step": 8, "step": 8, "attempt": 1}
    with db_session_factory() as s:  # the scheduler's own count agrees, so a later state change keeps it
        assert attempts(s, job_id) == 1


def test_resume_failed_job_without_checkpoint_starts_over_and_says_so(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    job_id = _submit(client, tokens["a"])
    _run_to(db_session_factory, job_id, JobState.FAILED, step=5, checkpoints={4: False})
    r = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["a"]))
    assert r.status_code == 200, r.text
    job = r.json()
    assert (job["state"], job["attempt"], job["progress"]["step"], job["error"]) == ("queued", 1, 0, None)
    assert "step 0" in job["reason"] and "no verified checkpoint" in job["reason"]
    # it can fail again and be resumed again: a second new attempt
    with store.session_scope(db_session_factory) as s:
        store.transition(s, job_id, JobState.FAILED, reason="again")
    again = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["a"])).json()
    assert (again["state"], again["attempt"]) == ("queued", 2)


def test_resume_refuses_succeeded_and_unfinished_jobs_and_changes_nothing(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    h = bearer(tokens["a"])
    done = _submit(client, tokens["a"])
    _run_to(db_session_factory, done, JobState.SUCCEEDED, step=16)
    running = _submit(client, tokens["a"])
    with store.session_scope(db_session_factory) as s:
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING):
            store.transition(s, running, state)
    pending = _submit(client, tokens["a"])
    for job_id, state in ((done, "succeeded"), (running, "running"), (pending, "pending")):
        before = _snapshot(db_session_factory, job_id)
        r = client.post(f"/v1/jobs/{job_id}/resume", headers=h)
        assert r.status_code == 409, (state, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert f"is {state}" in r.json()["detail"]
        assert _snapshot(db_session_factory, job_id) == before
    # resuming twice: the second answers 409 (the job is queued again)
    cancelled = _submit(client, tokens["a"])
    assert client.post(f"/v1/jobs/{cancelled}/cancel", headers=h).json()["state"] == "cancelled"
    assert client.post(f"/v1/jobs/{cancelled}/resume", headers=h).status_code == 200
    second = client.post(f"/v1/jobs/{cancelled}/resume", headers=h)
    assert second.status_code == 409 and "is queued" in second.json()["detail"]


def test_resume_waits_for_ranks_still_stopping(
    app: FastAPI, client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    job_id = _submit(client, tokens["a"])
    _run_to(db_session_factory, job_id, JobState.CANCELLED, step=3)
    app.state.scheduler = Scheduler(attached=(job_id,))
    before = _snapshot(db_session_factory, job_id)
    r = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["a"]))
    assert r.status_code == 409 and "still stopping" in r.json()["detail"]
    assert _snapshot(db_session_factory, job_id) == before


def test_resume_another_tenants_job_is_404_and_admin_may(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    job_id = _submit(client, tokens["a"])
    _run_to(db_session_factory, job_id, JobState.FAILED, step=2)
    before = _snapshot(db_session_factory, job_id)
    r = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["b"]))
    assert r.status_code == 404
    assert client.post("/v1/jobs/NOSUCHJOB/resume", headers=bearer(tokens["a"])).status_code == 404
    assert _snapshot(db_session_factory, job_id) == before
    r = client.post(f"/v1/jobs/{job_id}/resume", headers=bearer(tokens["admin"]))
    assert r.json()["state"] == "queued"
