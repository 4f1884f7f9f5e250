"""/v1/tenants: an admin sets a tenant's priority cap, GPU quota, weight and borrowing through the
API, and the submit path obeys the cap."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.conftest import bearer
from tests.api.specs import tiny


def test_admin_sets_a_tenant_cap_that_user_submits_obey(client: TestClient, tokens: dict[str, str]) -> None:
    admin, user = bearer(tokens["admin"]), bearer(tokens["a"])
    assert client.post("/v1/jobs", json=tiny(priority=300), headers=user).status_code == 422  # default 100
    r = client.put("/v1/tenants/team-a", json={"max_priority": 500}, headers=admin)
    assert r.status_code == 200
    assert r.json() == {"name": "team-a", "max_priority": 500, "default_max_priority": 100,
                        "gpu_quota": None, "weight": 1.0, "borrowing": False}
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


def test_quota_weight_and_borrowing_round_trip_and_a_put_keeps_fields_it_leaves_out(
    client: TestClient, tokens: dict[str, str]
) -> None:
    admin = bearer(tokens["admin"])
    r = client.put("/v1/tenants/team-a", json={"gpu_quota": 8, "weight": 2.5, "borrowing": True,
                                               "max_priority": 200}, headers=admin)
    assert r.status_code == 200
    assert r.json() == {"name": "team-a", "max_priority": 200, "default_max_priority": 100,
                        "gpu_quota": 8, "weight": 2.5, "borrowing": True}
    r = client.put("/v1/tenants/team-a", json={"weight": 1}, headers=admin)  # only the weight changes
    assert (r.json()["weight"], r.json()["gpu_quota"], r.json()["borrowing"], r.json()["max_priority"]) == \
        (1.0, 8, True, 200)
    cleared = client.put("/v1/tenants/team-a", json={"gpu_quota": None}, headers=admin)
    assert cleared.json()["gpu_quota"] is None
    listed = {t["name"]: t for t in client.get("/v1/tenants", headers=admin).json()["items"]}
    assert (listed["team-a"]["gpu_quota"], listed["team-a"]["borrowing"]) == (None, True)
    assert (listed["team-b"]["gpu_quota"], listed["team-b"]["weight"], listed["team-b"]["borrowing"]) == \
        (None, 1.0, False)


def test_bad_quota_weight_or_borrowing_is_a_422_naming_the_field_and_users_get_403(
    client: TestClient, tokens: dict[str, str]
) -> None:
    admin, user = bearer(tokens["admin"]), bearer(tokens["a"])
    assert client.put("/v1/tenants/team-a", json={"gpu_quota": 8}, headers=user).status_code == 403
    for body, field in (({"gpu_quota": -1}, "gpu_quota"), ({"gpu_quota": "lots"}, "gpu_quota"),
                        ({"weight": 0}, "weight"), ({"weight": None}, "weight"), ({"weight": 1e9}, "weight"),
                        ({"borrowing": None}, "borrowing"), ({"borrowing": "maybe"}, "borrowing")):
        r = client.put("/v1/tenants/team-a", json=body, headers=admin)
        assert r.status_code == 422, body
        assert r.headers["content-type"].startswith("application/problem+json") and field in r.text, r.text
    # nothing was changed by the refused requests
    listed = {t["name"]: t for t in client.get("/v1/tenants", headers=admin).json()["items"]}
    assert (listed["team-a"]["gpu_quota"], listed["team-a"]["weight"]) == (None, 1.0)
