"""POST /v1/jobs/{id}/faults refuses clearly: admin only, fault injection on, a live job, a valid fault."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.api.app import create_app
from service.api.routes import faults
from service.schemas import EXPLICIT_SPEC
from service.settings import Settings
from tests.api.conftest import bearer, tokens

__all__ = ["tokens"]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'lattice.db'}"


def _client(tmp_path: Path, engine: Engine, injection: bool) -> Iterator[TestClient]:
    settings = Settings(home=tmp_path / "home", database_url=str(engine.url), fault_injection=injection)
    app = create_app(settings, engine=engine)
    if not any(getattr(r, "path", "") == "/v1/jobs/{job_id}/faults" for r in app.routes):
        app.include_router(faults.router)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def on(tmp_path: Path, db_engine: Engine) -> Iterator[TestClient]:
    yield from _client(tmp_path, db_engine, True)


@pytest.fixture
def off(tmp_path: Path, db_engine: Engine) -> Iterator[TestClient]:
    yield from _client(tmp_path, db_engine, False)


def _job(client: TestClient, token: str) -> str:
    # Without the spec's own faults: those need an admin token and injection on (tests/api/test_limits.py).
    spec = {k: v for k, v in EXPLICIT_SPEC.items() if k != "faults"}
    r = client.post("/v1/jobs", json=spec, headers=bearer(token))
    assert r.status_code == 201, r.text
    return r.json()["id"]


KILL = {"kind": "kill_rank", "rank": 1, "at_step": 3}


def test_a_user_token_is_forbidden(on: TestClient, tokens: dict[str, str]) -> None:
    job = _job(on, tokens["a"])
    r = on.post(f"/v1/jobs/{job}/faults", json=KILL, headers=bearer(tokens["a"]))
    assert r.status_code == 403 and r.headers["content-type"].startswith("application/problem+json")
    assert "admin" in r.json()["detail"]


def test_disabled_fault_injection_is_a_conflict_naming_the_setting(
    off: TestClient, tokens: dict[str, str]
) -> None:
    job = _job(off, tokens["admin"])
    r = off.post(f"/v1/jobs/{job}/faults", json=KILL, headers=bearer(tokens["admin"]))
    assert r.status_code == 409 and "LATTICE_FAULT_INJECTION=true" in r.json()["detail"]


def test_a_job_that_is_not_running_is_refused(on: TestClient, tokens: dict[str, str]) -> None:
    job = _job(on, tokens["admin"])
    r = on.post(f"/v1/jobs/{job}/faults", json=KILL, headers=bearer(tokens["admin"]))
    assert r.status_code == 409 and "can only be injected" in r.json()["detail"]
    missing = on.post("/v1/jobs/NOSUCHJOB/faults", json=KILL, headers=bearer(tokens["admin"]))
    assert missing.status_code == 404


def test_an_unknown_fault_kind_is_a_validation_error(on: TestClient, tokens: dict[str, str]) -> None:
    job = _job(on, tokens["admin"])
    melt = {"kind": "melt", "at_step": 1}
    r = on.post(f"/v1/jobs/{job}/faults", json=melt, headers=bearer(tokens["admin"]))
    assert r.status_code == 422 and "kind" in r.text
