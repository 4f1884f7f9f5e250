"""Input limits: the body limit before authentication, capped JSON depth, spec faults and allow_unfit
for admins only, the non-admin priority cap, and 503 + Retry-After when the database is down.
Every refusal is a problem+json naming the field, and stores nothing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from service.api import operations
from service.api.app import create_app
from service.settings import Settings
from service.store.db import make_engine
from service.store.models import Job, JobEvent, Tenant
from tests.api.conftest import bearer
from tests.api.specs import tiny

UNFIT_MODEL = {"layers": 48, "hidden": 8192, "heads": 64, "vocab": 32000, "seq_len": 32}
KILL_RANK = {"kind": "kill_rank", "at_step": 1, "rank": 0}


def stored(sf: sessionmaker[Session]) -> tuple[int, int]:
    with sf() as s:
        return (
            s.scalar(select(func.count()).select_from(Job)) or 0,
            s.scalar(select(func.count()).select_from(JobEvent)) or 0,
        )


def problem(r: Any, status: int, field: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert field in [e["field"] for e in body.get("errors") or []], body
    return body


# ---- body limit -----------------------------------------------------------------------------------
def call(app: FastAPI, headers: list[tuple[bytes, bytes]], chunks: int, chunk: bytes) -> tuple[int, int]:
    """POST /v1/jobs straight into the ASGI app; returns (status, body chunks the app pulled)."""
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": pulled < chunks}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/jobs", "raw_path": b"/v1/jobs", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1), "server": ("testserver", 80), "app": app,
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], pulled


def test_oversized_unauthenticated_body_is_413_before_auth_and_never_read(
    client: TestClient, app: FastAPI, db_session_factory: sessionmaker[Session]
) -> None:
    before = stored(db_session_factory)
    r = client.post("/v1/jobs", content=b"{" * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text  # not 401: the limit comes before authentication
    assert r.headers["content-type"] == "application/problem+json"
    assert "1048576 bytes" in r.json()["detail"]
    # Declared 200 MiB: answered without pulling a single body chunk.
    status, pulled = call(app, [(b"content-length", str(200 << 20).encode())], 3200, b"x" * (64 << 10))
    assert (status, pulled) == (413, 0)
    # Chunked (no Content-Length): stops pulling just past the limit, never parses.
    status, pulled = call(app, [], 3200, b"x" * (64 << 10))
    assert status == 413 and pulled == (1 << 20) // (64 << 10) + 1
    assert stored(db_session_factory) == before


def test_chunked_body_under_the_limit_reaches_the_route(app: FastAPI, tokens: dict[str, str]) -> None:
    body = json.dumps(tiny()).encode()
    auth = [(b"authorization", f"Bearer {tokens['a']}".encode())]
    third = len(body) // 3 + 1
    pieces = [body[i: i + third] for i in range(0, len(body), third)]
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": pieces[pulled - 1], "more_body": pulled < len(pieces)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/jobs", "raw_path": b"/v1/jobs", "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *auth],
        "client": ("127.0.0.1", 1), "server": ("testserver", 80), "app": app,
    }
    asyncio.run(app(scope, receive, send))
    assert next(m for m in sent if m["type"] == "http.response.start")["status"] == 201


# ---- depth and serialisation ----------------------------------------------------------------------
def test_deep_json_is_422_and_the_admin_list_still_works(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    deep: Any = 1
    for _ in range(255):
        deep = [deep]
    before = stored(db_session_factory)
    r = client.post("/v1/jobs", json=tiny(faults=[{**KILL_RANK, "x": deep}]), headers=bearer(tokens["admin"]))
    body = problem(r, 422, "faults")
    assert "nested too deeply" in body["detail"] and "at most 8 levels" in body["detail"]
    r = client.post("/v1/jobs", json=tiny(name=deep), headers=bearer(tokens["a"]))
    problem(r, 422, "name")
    admin = bearer(tokens["admin"])
    r = client.post("/v1/jobs", json=tiny(faults=[{**KILL_RANK, "colour": "red"}]), headers=admin)
    assert problem(r, 422, "faults[0].colour")["errors"][0]["message"] == "unknown field (not allowed here)"
    assert stored(db_session_factory) == before
    assert client.get("/v1/jobs", headers=bearer(tokens["admin"])).status_code == 200


def test_a_job_that_would_not_serialise_is_never_committed(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unservable(job: Job) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    before = stored(db_session_factory)
    monkeypatch.setattr(operations.JobPublic, "from_row", unservable)
    r = client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["a"]))
    problem(r, 422, "body")
    assert stored(db_session_factory) == before


# ---- who may ask for what --------------------------------------------------------------------------
def test_user_priority_is_capped_admins_are_not(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    before = stored(db_session_factory)
    user, admin = bearer(tokens["a"]), bearer(tokens["admin"])
    body = problem(client.post("/v1/jobs", json=tiny(priority=101), headers=user), 422, "priority")
    assert "at most 100" in body["detail"]
    assert stored(db_session_factory) == before
    assert client.post("/v1/jobs", json=tiny(priority=100), headers=bearer(tokens["a"])).status_code == 201
    assert client.post("/v1/jobs", json=tiny(priority=1000), headers=admin).status_code == 201
    with db_session_factory() as s:  # an admin-set cap for team-a
        s.execute(update(Tenant).where(Tenant.name == "team-a").values(max_priority=500))
        s.commit()
    assert client.post("/v1/jobs", json=tiny(priority=500), headers=bearer(tokens["a"])).status_code == 201
    body = problem(client.post("/v1/jobs", json=tiny(priority=501), headers=user), 422, "priority")
    assert "at most 500" in body["detail"]
    problem(client.post("/v1/jobs", json=tiny(priority=101), headers=bearer(tokens["b"])), 422, "priority")


def test_unfit_plans_are_refused_unless_an_admin_allows_them(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    unfit = tiny(model=UNFIT_MODEL)
    before = stored(db_session_factory)
    for token in (tokens["a"], tokens["admin"]):
        body = problem(client.post("/v1/jobs", json=unfit, headers=bearer(token)), 422, "parallelism")
        assert "does not fit: needs" in body["detail"] and "per GPU" in body["detail"]
    r = client.post("/v1/jobs", json={**unfit, "allow_unfit": True}, headers=bearer(tokens["a"]))
    problem(r, 403, "allow_unfit")
    assert stored(db_session_factory) == before
    r = client.post("/v1/jobs", json={**unfit, "allow_unfit": True}, headers=bearer(tokens["admin"]))
    assert r.status_code == 201 and r.json()["plan"]["fits"] is False
    # A partial layout none of whose completions fits: refused, or completed when allowed.
    partial = tiny(model={"preset": "demo"}, parallelism={"tp": 2, "dp": 4, "zero_stage": 0},
                   resources={"gpus": 8})
    problem(client.post("/v1/jobs", json=partial, headers=bearer(tokens["admin"])), 422, "parallelism")
    r = client.post("/v1/jobs", json={**partial, "allow_unfit": True}, headers=bearer(tokens["admin"]))
    assert r.status_code == 201 and r.json()["plan"]["fits"] is False
    assert {k: r.json()["plan"]["layout"][k] for k in ("tp", "dp", "pp", "zero_stage")} == \
        {"tp": 2, "dp": 4, "pp": 1, "zero_stage": 0}


@pytest.mark.parametrize("injection", [False, True], ids=["injection-off", "injection-on"])
def test_spec_faults_need_an_admin_and_injection_on(
    tmp_path: Path, db_url: str, db_engine: Engine, tokens: dict[str, str],
    db_session_factory: sessionmaker[Session], injection: bool,
) -> None:
    settings = Settings(home=tmp_path / "home", database_url=db_url, fault_injection=injection)
    with TestClient(create_app(settings, engine=db_engine)) as client:
        spec = tiny(faults=[KILL_RANK])
        before = stored(db_session_factory)
        body = problem(client.post("/v1/jobs", json=spec, headers=bearer(tokens["a"])), 403, "faults")
        assert "admin token" in body["detail"]
        r = client.post("/v1/jobs", json=spec, headers=bearer(tokens["admin"]))
        if not injection:
            assert "LATTICE_FAULT_INJECTION=true" in problem(r, 422, "faults")["detail"]
            assert stored(db_session_factory) == before
        else:
            assert r.status_code == 201 and r.json()["spec"]["faults"][0]["kind"] == "kill_rank"
        assert client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["a"])).status_code == 201


# ---- database down -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dead_url",
    ["sqlite:////nonexistent-dir/lattice.db",
     pytest.param("postgresql+psycopg://postgres@127.0.0.1:1/test", marks=pytest.mark.postgres)],
    ids=["sqlite", "postgresql"],
)
def test_database_down_is_503_with_retry_after(tmp_path: Path, dead_url: str) -> None:
    engine = make_engine(dead_url)
    app = create_app(Settings(home=tmp_path / "home", database_url=dead_url), engine=engine)
    with TestClient(app, raise_server_exceptions=False) as client:
        for headers in ({"Authorization": "Bearer lat_x"}, {}):
            r = client.get("/v1/jobs", headers=headers)
            if not headers:
                assert r.status_code == 401  # no token: refused before any database access
                continue
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/problem+json"
            assert int(r.headers["Retry-After"]) > 0 and "database is unavailable" in r.json()["detail"]
    engine.dispose()
