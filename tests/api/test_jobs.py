"""Submit, read, list, cancel and the event log over HTTP, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.api.app import create_app
from service.schemas import DEMO_SPEC
from service.settings import Settings
from service.store.models import Job, JobState
from tests.api.conftest import bearer
from tests.api.specs import tiny


def test_submit_auto_stores_the_planners_plan(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json=DEMO_SPEC, headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    job = r.json()
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert (job["state"], job["tenant"], job["name"], job["version"]) == ("pending", "team-a", "demo", 0)
    progress = job["progress"]
    assert {k: progress[k] for k in ("step", "total_steps", "loss", "tokens_per_s", "mfu")} == {
        "step": 0, "total_steps": 30, "loss": None, "tokens_per_s": None, "mfu": None}
    assert progress["step_time_s"] is None and progress["eta_s"] is None
    assert progress["goodput"]["useful_s"] == 0 and job["reason"] == "pending"  # not started: only queued
    assert job["plan"]["mode"] == "search"
    layout = job["plan"]["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] * layout["cp"] == 8  # resources.gpus
    assert job["spec"]["model"] == {"preset": "demo"} and job["spec"]["checkpoint"]["keep"] == 2
    again = client.get(f"/v1/jobs/{job['id']}", headers=bearer(tokens["a"])).json()
    # The goodput parts are read at the time of the request: a pending job's queued time grows.
    later, before = again["progress"].pop("goodput"), job["progress"].pop("goodput")
    assert again == job and later["queued_s"] >= before["queued_s"]


def test_submit_explicit_layout_is_evaluated(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    assert plan["mode"] == "evaluate"
    assert {k: plan["layout"][k] for k in ("tp", "dp", "pp", "num_microbatches")} == {
        "tp": 2,
        "dp": 2,
        "pp": 1,
        "num_microbatches": 2,
    }


def test_list_filters_by_state_and_pages_without_gaps(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    ids = [
        client.post("/v1/jobs", json=tiny(name=f"j{i}"), headers=bearer(tokens["a"])).json()["id"]
        for i in range(5)
    ]
    with store.session_scope(db_session_factory) as s:
        store.transition(s, ids[1], JobState.QUEUED)
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/jobs", params=params, headers=bearer(tokens["a"])).json()
        seen += [j["id"] for j in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert (seen, pages) == (ids[::-1], 3)
    queued = client.get("/v1/jobs", params={"state": "queued"}, headers=bearer(tokens["a"])).json()
    assert [j["id"] for j in queued["items"]] == [ids[1]]
    both = client.get(
        "/v1/jobs", params=[("state", "queued"), ("state", "pending")], headers=bearer(tokens["a"])
    )
    assert len(both.json()["items"]) == 5


def test_cancel_pending_then_again_then_finished_job(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    h = bearer(tokens["a"])
    job_id = client.post("/v1/jobs", json=tiny(), headers=h).json()["id"]
    r = client.post(f"/v1/jobs/{job_id}/cancel", headers=h)
    assert (r.status_code, r.json()["state"], r.json()["version"]) == (200, "cancelled", 1)
    assert r.json()["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job_id}/cancel", headers=h)
    assert (again.status_code, again.json()["version"]) == (200, 1)

    done_id = client.post("/v1/jobs", json=tiny(), headers=h).json()["id"]
    with store.session_scope(db_session_factory) as s:
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED):
            store.transition(s, done_id, state)
    r = client.post(f"/v1/jobs/{done_id}/cancel", headers=h)
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert "already succeeded" in r.json()["detail"]


class RecordingScheduler:
    """Stands in for the scheduler seam (app.state.scheduler): records what the API asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None]] = []

    def wake(self) -> None:
        self.calls.append(("wake", None))

    def cancel(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))


def test_cancel_running_job_tells_the_scheduler(
    app: FastAPI, client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    scheduler = RecordingScheduler()
    app.state.scheduler = scheduler
    h = bearer(tokens["a"])
    queued = client.post("/v1/jobs", json=tiny(), headers=h).json()["id"]
    running = client.post("/v1/jobs", json=tiny(), headers=h).json()["id"]
    assert scheduler.calls == [("wake", None), ("wake", None)]
    with store.session_scope(db_session_factory) as s:
        store.transition(s, queued, JobState.QUEUED)
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING):
            store.transition(s, running, state)
    scheduler.calls.clear()
    assert client.post(f"/v1/jobs/{queued}/cancel", headers=h).json()["state"] == "cancelled"
    assert scheduler.calls == [("wake", None)]
    scheduler.calls.clear()
    assert client.post(f"/v1/jobs/{running}/cancel", headers=h).json()["state"] == "cancelled"
    assert scheduler.calls == [("cancel", running), ("wake", None)]


def test_events_page_through_the_log(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    h = bearer(tokens["a"])
    job_id = client.post("/v1/jobs", json=tiny(), headers=h).json()["id"]
    client.post(f"/v1/jobs/{job_id}/cancel", headers=h)
    with store.session_scope(db_session_factory) as s:
        for step in range(3):
            store.append_event(s, job_id, "note", {"i": step})
    first = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 2}, headers=h).json()
    assert [(e["seq"], e["type"]) for e in first["items"]] == [(1, "created"), (2, "state")]
    assert first["items"][1]["payload"]["to"] == "cancelled"
    rest = client.get(f"/v1/jobs/{job_id}/events", params={"after": first["next_after"]}, headers=h).json()
    assert [e["seq"] for e in rest["items"]] == [3, 4, 5] and rest["next_after"] is None


def test_idempotency_key_replays_or_conflicts(client: TestClient, tokens: dict[str, str]) -> None:
    h = bearer(tokens["a"]) | {"Idempotency-Key": "retry-1"}
    first = client.post("/v1/jobs", json=tiny(), headers=h)
    replay = client.post("/v1/jobs", json=tiny(), headers=h)
    assert (first.status_code, replay.status_code) == (201, 200)
    assert replay.json()["id"] == first.json()["id"] and replay.headers["idempotent-replayed"] == "true"
    # Same meaning, different bytes (defaults spelled out) is the same request.
    spelled = tiny(priority=0, data={"kind": "synthetic"})
    assert client.post("/v1/jobs", json=spelled, headers=h).json()["id"] == first.json()["id"]
    conflict = client.post("/v1/jobs", json=tiny(name="other"), headers=h)
    assert conflict.status_code == 409
    assert "different request body" in conflict.json()["detail"]
    # Keys are per tenant: another tenant's identical key is a different job.
    other = client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["b"]) | {"Idempotency-Key": "retry-1"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]


def test_twenty_concurrent_submits_with_one_key_create_one_job(
    settings: Settings, db_engine: Engine, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    # Idempotency under a burst, not load shedding: the burst waits for the API's slots however slow
    # the machine (LATTICE_MAX_INFLIGHT_REQUESTS=0; shedding is tests/api/test_overload.py's).
    app = create_app(settings.model_copy(update={"max_inflight_requests": 0}), engine=db_engine)

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lattice") as c:
            headers = bearer(tokens["a"]) | {"Idempotency-Key": "burst"}
            return await asyncio.gather(
                *(c.post("/v1/jobs", json=tiny(), headers=headers) for _ in range(20))
            )

    responses = asyncio.run(burst())
    assert sorted(r.status_code for r in responses) == [200] * 19 + [201], [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    with db_session_factory() as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 1
