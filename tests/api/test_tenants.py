"""/v1/tenants: an admin sets a tenant's priority cap through the API and the submit path obeys it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.conftest import bearer
from tests.api.specs import tiny


def test_admin_sets_a_tenant_cap_that_user_submits_obey(client: TestClient, tokens: dict[str, str]) -> None:
    admin, user = bearer(tokens["admin"]), bearer(tokens["a"])
    assert client.post("/v1/jobs", json=tiny(priority=300), headers=user).status_code == 422  # default 100
    r = client.put("/v1/tenants/team-a", json={"max_priority": 500}, headers=admin)
    assert r.status_code == 200
    assert r.json() == {"name": "team-a", "max_priority": 500, "default_max_priority": 100}
    assert client.post("/v1/jobs", json=tiny(priority=300), headers=user).status_code == 201
    assert client.post("/v1/jobs", json=tiny(priority=300), headers=bearer(tokens["b"])).status_code == 422
    listed = {t["name"]: t["max_priority"] for t in client.get("/v1/tenants", headers=admin).json()["items"]}
    assert listed["team-a"] == 500 and listed["team-b"] is None
    cleared = client.put("/v1/tenants/team-a", json={"max_priority": None}, headers=admin)
    assert cleared.json()["max_priority"] is None
    assert client.post("/v1/jobs", json=tiny(priority=300), headers=user).status_code == 422


def test_only_admins_manage_tenants_and_bad_bodies_name_the_field(
    client: TestClient, tokens: dict[str, str]
) -> None:
    user, admin = bearer(tokens["a"]), bearer(tokens["admin"])
    assert client.put("/v1/tenants/team-a", json={"max_priority": 1000}, headers=user).status_code == 403
    assert client.get("/v1/tenants", headers=user).status_code == 403
    for body, field in (({"max_priority": 5000}, "max_priority"), ({"max_priority": 1, "quota": 3}, "quota")):
        r = client.put("/v1/tenants/team-a", json=body, headers=admin)
        assert r.status_code == 422 and field in r.text
    assert client.put("/v1/tenants/..bad", json={"max_priority": 1}, headers=admin).status_code == 422
    created = client.put("/v1/tenants/new-team", json={"max_priority": 7}, headers=admin)
    assert created.status_code == 200 and created.json()["max_priority"] == 7
