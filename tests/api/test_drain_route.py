"""An admin's drain through an API process with no scheduler in it (role api) is recorded in the store
for the leading scheduler; uncordon ends it."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.store.models import Node
from tests.api.conftest import bearer


def test_a_drain_is_recorded_for_the_scheduler_and_uncordon_ends_it(
        client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        store.upsert_node(s, "r1-n1", rack="r1", gpus=4)
    assert client.post("/v1/cluster/nodes/r1-n1/drain", headers=bearer(tokens["a"])).status_code == 403
    r = client.post("/v1/cluster/nodes/r1-n1/drain", headers=bearer(tokens["admin"]))
    assert r.status_code == 200, r.text
    with db_session_factory() as s:
        row = s.get(Node, "r1-n1")
        assert row is not None and row.health == "cordoned"
        assert row.drain_reason is not None and "drained by an admin" in row.drain_reason
    r = client.post("/v1/cluster/nodes/r1-n1/uncordon", headers=bearer(tokens["admin"]))
    assert r.status_code == 200, r.text
    with db_session_factory() as s:
        row = s.get(Node, "r1-n1")
        assert row is not None and row.health == "ready" and row.drain_reason is None
