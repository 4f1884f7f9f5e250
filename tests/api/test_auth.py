"""Bearer tokens, roles and tenant isolation over HTTP."""

from __future__ import annotations

from fastapi.testclient import TestClient

from tests.api.conftest import bearer
from tests.api.specs import tiny


def test_missing_or_bad_token_is_401_problem(client: TestClient, tokens: dict[str, str]) -> None:
    for headers in ({}, bearer("lat_nope"), {"Authorization": "Basic dXNlcjpwYXNz"}):
        r = client.get("/v1/jobs", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["status"] == 401 and "token" in r.json()["detail"]
    assert client.post("/v1/jobs", json=tiny()).status_code == 401
    plan_body = {
        "model": {"preset": "demo"},
        "global_batch": 8,
        "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8},
    }
    assert client.post("/v1/plans", json=plan_body).status_code == 401
    assert client.post("/v1/plans", json=plan_body, headers=bearer(tokens["a"])).status_code == 200


def test_users_see_only_their_tenant(client: TestClient, tokens: dict[str, str]) -> None:
    a, b, admin = bearer(tokens["a"]), bearer(tokens["b"]), bearer(tokens["admin"])
    job_a = client.post("/v1/jobs", json=tiny(name="a-job"), headers=a).json()["id"]
    job_b = client.post("/v1/jobs", json=tiny(name="b-job"), headers=b).json()["id"]

    for path in (f"/v1/jobs/{job_a}", f"/v1/jobs/{job_a}/events"):
        r = client.get(path, headers=b)
        assert r.status_code == 404 and r.json()["detail"] == f"job {job_a!r} not found"
    assert client.post(f"/v1/jobs/{job_a}/cancel", headers=b).status_code == 404
    assert client.get(f"/v1/jobs/{job_a}", headers=a).json()["state"] == "pending"  # b's cancel did nothing

    assert [j["id"] for j in client.get("/v1/jobs", headers=b).json()["items"]] == [job_b]
    assert client.get("/v1/jobs", params={"tenant": "team-a"}, headers=b).json()["items"] == []

    everyone = [j["id"] for j in client.get("/v1/jobs", headers=admin).json()["items"]]
    assert everyone == [job_b, job_a]
    only_a = client.get("/v1/jobs", params={"tenant": "team-a"}, headers=admin).json()["items"]
    assert [j["id"] for j in only_a] == [job_a]
    assert client.post(f"/v1/jobs/{job_a}/cancel", headers=admin).json()["state"] == "cancelled"


def test_only_admins_create_tokens(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.post("/v1/tokens", json={"tenant": "team-c"}, headers=bearer(tokens["a"]))
    assert r.status_code == 403 and r.headers["content-type"] == "application/problem+json"
    r = client.post("/v1/tokens", json={"tenant": "team-c"}, headers=bearer(tokens["admin"]))
    assert r.status_code == 201 and r.json()["role"] == "user"
    new = bearer(r.json()["token"])
    job = client.post("/v1/jobs", json=tiny(), headers=new).json()
    assert job["tenant"] == "team-c"
    assert client.post("/v1/tokens", json={"tenant": "x"}, headers=new).status_code == 403
