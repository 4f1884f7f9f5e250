"""`preemption.preemptible: false` is for admins only (a 403 naming the field, nothing stored);
`preemption.grace_s` is bounded and defaults to 120 s in the stored spec."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from tests.api.conftest import bearer
from tests.api.specs import tiny
from tests.api.test_limits import problem, stored


def test_only_an_admin_may_opt_a_job_out_of_preemption(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    pinned = tiny(preemption={"preemptible": False})
    before = stored(db_session_factory)
    body = problem(client.post("/v1/jobs", json=pinned, headers=bearer(tokens["a"])), 403,
                   "preemption.preemptible")
    assert "admin" in body["detail"]
    assert stored(db_session_factory) == before
    r = client.post("/v1/jobs", json=pinned, headers=bearer(tokens["admin"]))
    assert r.status_code == 201 and r.json()["spec"]["preemption"] == {"grace_s": 120.0, "preemptible": False}
    problem(client.post("/v1/jobs", json=tiny(preemption={"grace_s": 4000}), headers=bearer(tokens["a"])),
            422, "preemption.grace_s")
    r = client.post("/v1/jobs", json=tiny(preemption={"grace_s": 30}), headers=bearer(tokens["a"]))
    assert r.status_code == 201 and r.json()["spec"]["preemption"]["preemptible"] is True
