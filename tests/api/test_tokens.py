"""Token lifecycle over HTTP: list, revoke, expiry, last use; /metrics behind a token; node faults
redacted for users. SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.api.app import create_app
from service.auth import TOUCH_INTERVAL, hash_token
from service.settings import Settings
from service.store.models import ApiToken, utcnow
from tests.api.conftest import bearer

PUBLIC_FIELDS = {
    "id", "tenant", "role", "description", "status", "created_at", "expires_at", "last_used_at", "revoked_at"
}


def _row(factory: sessionmaker[Session], token: str) -> ApiToken:
    with factory() as s:
        row = s.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
        assert row is not None
        return row


def _set(factory: sessionmaker[Session], token: str, **values: Any) -> None:
    with factory() as s:
        s.execute(update(ApiToken).where(ApiToken.token_hash == hash_token(token)).values(**values))
        s.commit()


def _ids(factory: sessionmaker[Session], tokens: dict[str, str]) -> dict[str, int]:
    return {name: _row(factory, t).id for name, t in tokens.items()}


def _assert_401(r: Any, word: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert word in r.json()["detail"]


def test_admin_lists_every_token_and_never_a_secret(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    admin = bearer(tokens["admin"])
    made = client.post("/v1/tokens", json={"tenant": "team-c", "ttl_s": 30 * 86400, "description": "ci"},
                       headers=admin)
    assert made.status_code == 201, made.text
    body = made.json()
    expires = dt.datetime.fromisoformat(body["expires_at"])
    assert dt.timedelta(days=29, hours=23) < expires - utcnow() <= dt.timedelta(days=30)

    r = client.get("/v1/tokens", headers=admin)
    assert r.status_code == 200
    items = r.json()["items"]
    assert [(t["tenant"], t["role"]) for t in items] == [
        ("ops", "admin"), ("team-a", "user"), ("team-b", "user"), ("team-c", "user")
    ]
    assert all(set(t) == PUBLIC_FIELDS for t in items)
    assert items[3]["id"] == body["id"] and items[3]["expires_at"] is not None
    assert items[3]["description"] == "ci" and items[3]["status"] == "active"
    for secret in (*tokens.values(), body["token"], hash_token(body["token"])):
        assert secret not in r.text
    only_b = client.get("/v1/tokens", params={"tenant": "team-b"}, headers=admin).json()["items"]
    assert [t["tenant"] for t in only_b] == ["team-b"]


def test_users_see_and_revoke_only_their_tenants_user_tokens(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    admin, a = bearer(tokens["admin"]), bearer(tokens["a"])
    second_a = client.post("/v1/tokens", json={"tenant": "team-a"}, headers=admin).json()
    ids = _ids(db_session_factory, tokens)

    listed = client.get("/v1/tokens", headers=a).json()["items"]
    assert [t["id"] for t in listed] == [ids["a"], second_a["id"]]
    assert client.get("/v1/tokens", params={"tenant": "team-b"}, headers=a).json()["items"] == []

    # Another tenant's token, an admin token and a token that does not exist answer alike.
    for other in (ids["b"], ids["admin"], 999_999):
        r = client.delete(f"/v1/tokens/{other}", headers=a)
        assert r.status_code == 404 and r.json()["detail"] == f"token {other} not found"
    assert client.get("/v1/jobs", headers=bearer(tokens["b"])).status_code == 200  # b still works
    assert client.get("/v1/jobs", headers=admin).status_code == 200
    assert all(_row(db_session_factory, t).revoked_at is None for t in tokens.values())

    r = client.delete(f"/v1/tokens/{second_a['id']}", headers=a)
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    revoked_at = r.json()["revoked_at"]
    _assert_401(client.get("/v1/jobs", headers=bearer(second_a["token"])), "revoked")
    again = client.delete(f"/v1/tokens/{second_a['id']}", headers=a)
    assert again.status_code == 200 and again.json()["revoked_at"] == revoked_at
    assert client.get("/v1/jobs", headers=a).status_code == 200


def test_revoked_and_expired_tokens_get_401(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    admin = bearer(tokens["admin"])
    ids = _ids(db_session_factory, tokens)
    assert client.delete(f"/v1/tokens/{ids['b']}", headers=admin).status_code == 200
    _assert_401(client.get("/v1/jobs", headers=bearer(tokens["b"])), "revoked")
    _assert_401(client.get("/v1/cluster", headers=bearer(tokens["b"])), "revoked")

    _set(db_session_factory, tokens["a"], expires_at=utcnow() - dt.timedelta(seconds=1))
    _assert_401(client.get("/v1/jobs", headers=bearer(tokens["a"])), "expired")
    _assert_401(client.post("/v1/plans", json={}, headers=bearer(tokens["a"])), "expired")
    statuses = {t["id"]: t["status"] for t in client.get("/v1/tokens", headers=admin).json()["items"]}
    assert statuses == {ids["admin"]: "active", ids["a"]: "expired", ids["b"]: "revoked"}

    _set(db_session_factory, tokens["a"], expires_at=utcnow() + dt.timedelta(hours=1))
    assert client.get("/v1/jobs", headers=bearer(tokens["a"])).status_code == 200


def test_the_last_live_admin_token_cannot_be_revoked(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    admin = bearer(tokens["admin"])
    ids = _ids(db_session_factory, tokens)
    r = client.delete(f"/v1/tokens/{ids['admin']}", headers=admin)
    assert r.status_code == 409 and "last live admin token" in r.json()["detail"]
    assert _row(db_session_factory, tokens["admin"]).revoked_at is None
    new_admin = client.post("/v1/tokens", json={"tenant": "ops", "admin": True}, headers=admin).json()
    assert client.delete(f"/v1/tokens/{ids['admin']}", headers=bearer(new_admin["token"])).status_code == 200
    _assert_401(client.get("/v1/tokens", headers=admin), "revoked")


@pytest.mark.parametrize(("ttl", "word"), [(10, "greater than or equal to 60"), (10**10, "less than"),
                                           ("30d", "integer")])
def test_bad_ttl_is_422_naming_the_field(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session], ttl: Any, word: str
) -> None:
    r = client.post("/v1/tokens", json={"tenant": "team-q", "ttl_s": ttl}, headers=bearer(tokens["admin"]))
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
    assert r.json()["errors"][0]["field"] == "ttl_s" and word in r.json()["errors"][0]["message"]
    with db_session_factory() as s:
        assert s.scalar(select(ApiToken).where(ApiToken.tenant == "team-q")) is None


class _CountingFactory:
    """Wraps the app's write-session factory to count the write transactions authentication opens."""

    def __init__(self, inner: sessionmaker[Session]) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self) -> Session:
        self.calls += 1
        return self.inner()


def test_last_use_is_recorded_at_most_once_a_minute(
    app: FastAPI, client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    a = bearer(tokens["a"])
    assert _row(db_session_factory, tokens["a"]).last_used_at is None
    before = utcnow()
    assert client.get("/v1/jobs", headers=a).status_code == 200
    first = _row(db_session_factory, tokens["a"]).last_used_at
    assert first is not None and first >= before

    counting = _CountingFactory(app.state.session_factory)
    app.state.session_factory = counting
    recent = utcnow() - TOUCH_INTERVAL / 2
    _set(db_session_factory, tokens["a"], last_used_at=recent)
    for _ in range(3):
        assert client.get("/v1/jobs", headers=a).status_code == 200
    assert counting.calls == 0  # a read stays a read: no write transaction for the token
    assert _row(db_session_factory, tokens["a"]).last_used_at == recent

    old = utcnow() - TOUCH_INTERVAL * 2
    _set(db_session_factory, tokens["a"], last_used_at=old)
    assert client.get("/v1/jobs", headers=a).status_code == 200
    assert counting.calls == 1
    assert _row(db_session_factory, tokens["a"]).last_used_at > old  # type: ignore[operator]
    listed = client.get("/v1/tokens", headers=a).json()["items"]
    assert listed[0]["last_used_at"] is not None


# ---- /metrics ------------------------------------------------------------------------------------
@pytest.fixture
def metrics_client(db_url: str, db_engine: Engine, tmp_path: Path) -> Iterator[TestClient]:
    scrape = tmp_path / "metrics-token"
    scrape.write_text("scrape-secret-123\n")
    settings = Settings(
        home=tmp_path / "home", database_url=db_url, metrics_auth=True, metrics_token_file=scrape
    )
    with TestClient(create_app(settings, engine=db_engine)) as c:
        yield c


def test_metrics_need_a_token_when_metrics_auth_is_on(
    metrics_client: TestClient, tokens: dict[str, str]
) -> None:
    _assert_401(metrics_client.get("/metrics"), "bearer token")
    _assert_401(metrics_client.get("/metrics", headers=bearer("lat_wrong")), "invalid")
    r = metrics_client.get("/metrics", headers=bearer(tokens["a"]))
    assert r.status_code == 403 and r.headers["content-type"] == "application/problem+json"
    for headers in (bearer(tokens["admin"]), bearer("scrape-secret-123")):
        r = metrics_client.get("/metrics", headers=headers)
        assert r.status_code == 200 and "lattice_" in r.text
    assert metrics_client.get("/healthz").status_code == 200  # probes stay open
    # The scrape token is good for /metrics only.
    _assert_401(metrics_client.get("/v1/jobs", headers=bearer("scrape-secret-123")), "invalid")


def test_metrics_stay_open_when_metrics_auth_is_off(client: TestClient) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200 and "lattice_" in r.text


# ---- /v1/cluster ---------------------------------------------------------------------------------
def test_last_fault_is_for_admins_only(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    with db_session_factory() as s:
        store.upsert_node(s, "r1-n1", hostname="h1", rack="r1", gpus=4)
        store.set_node_health(s, "r1-n1", "suspect", fault="job 01SECRETJOB of team-b: rank 3 died")
        s.commit()
    as_user = client.get("/v1/cluster", headers=bearer(tokens["a"]))
    assert as_user.status_code == 200
    (node,) = as_user.json()["nodes"]
    assert node["last_fault"] is None and node["fault_count"] == 1 and node["health"] == "suspect"
    assert "01SECRETJOB" not in as_user.text
    (node,) = client.get("/v1/cluster", headers=bearer(tokens["admin"])).json()["nodes"]
    assert node["last_fault"] == "job 01SECRETJOB of team-b: rank 3 died"
