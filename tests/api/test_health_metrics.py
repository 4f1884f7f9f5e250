"""/healthz, /readyz, /metrics and the OpenAPI document."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from service.store import migrate
from tests.api.conftest import bearer
from tests.api.specs import tiny


def test_health_and_readiness(client: TestClient, db_engine: Engine) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ready", "database": "ok", "migration": migrate.head_revision()}
    with db_engine.connect() as conn:  # a database behind the code: not ready
        conn.execute(text("UPDATE alembic_version SET version_num = 'old'"))
        conn.commit()
    r = client.get("/readyz")
    assert r.status_code == 503 and r.headers["content-type"] == "application/problem+json"
    assert "run the migrations" in r.json()["detail"]


def _sample(body: str, name: str, **labels: str) -> float:
    for line in body.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}") + 1]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_by_route_template_and_jobs_by_state(
    client: TestClient, tokens: dict[str, str]
) -> None:
    h = bearer(tokens["a"])
    route = "/v1/jobs/{job_id}"
    before = _sample(client.get("/metrics").text, "lattice_http_requests_total", route=route, status="200")
    job_ids = [client.post("/v1/jobs", json=tiny(), headers=h).json()["id"] for _ in range(3)]
    for job_id in job_ids:
        client.get(f"/v1/jobs/{job_id}", headers=h)
    client.post(f"/v1/jobs/{job_ids[0]}/cancel", headers=h)
    client.get("/v1/jobs/01NOTHERE", headers=h)

    body = client.get("/metrics").text
    assert _sample(body, "lattice_http_requests_total", route=route, method="GET", status="200") - before == 3
    assert _sample(body, "lattice_http_requests_total", route=route, method="GET", status="404") >= 1
    assert _sample(body, "lattice_http_request_duration_seconds_count", route="/v1/jobs", method="POST") >= 3
    assert f'job_id="{job_ids[0]}"' not in body  # raw paths never become labels
    assert _sample(body, "lattice_jobs", state="pending") == 2
    assert _sample(body, "lattice_jobs", state="cancelled") == 1
    assert _sample(body, "lattice_jobs", state="running") == 0
    assert "lattice_queue_depth 2.0" in body


def test_openapi_documents_errors_and_examples(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    submit = doc["paths"]["/v1/jobs"]["post"]
    examples = submit["requestBody"]["content"]["application/json"]["examples"]
    assert set(examples) == {"auto", "explicit"}
    assert doc["components"]["schemas"]["JobSpec"]["examples"][0]["model"] == {"preset": "demo"}
    assert {"201", "200", "401", "409", "422"} <= set(submit["responses"])
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    assert list(response["content"]) == ["application/problem+json"], (path, method, status)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
