"""Bad input: 4xx application/problem+json naming the field and what is allowed; never a 5xx."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import bearer
from tests.api.specs import TINY, tiny

# (what is wrong, the spec, the field the problem must name, words the message must contain)
BAD_SPECS: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "missing model field",
        tiny(model={"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}),
        "model.seq_len",
        "required",
    ),
    (
        "shape rule",
        tiny(model={"layers": 2, "hidden": 65, "heads": 4, "vocab": 256, "seq_len": 32}),
        "model.hidden",
        "divisible by model.heads",
    ),
    ("unknown preset", tiny(model={"preset": "gpt-9"}), "model.preset", "must be one of"),
    ("bad degree", tiny(parallelism={"tp": 0}), "parallelism.tp", "greater than or equal to 1"),
    (
        "layout rule",
        tiny(parallelism={"dp": 4, "pp": 1, "schedule": "1f1b"}),
        "parallelism",
        "must be 'none' when pp == 1",
    ),
    (
        "batch mismatch",
        tiny(parallelism={"dp": 2, "micro_batch_size": 1, "num_microbatches": 1}),
        "parallelism",
        "must equal train.global_batch (4)",
    ),
    (  # one micro-batch per rank (dp 4, global batch 4): too few for any 1F1B pipeline
        "schedule needs micro-batches",
        tiny(parallelism={"dp": 4, "schedule": "1f1b"}),
        "parallelism",
        "must be >= pp",
    ),
    ("auto misspelt", tiny(parallelism="automatic"), "parallelism", "'auto'"),
    ("unknown field", tiny(colour="blue"), "colour", "unknown field"),
    (
        "enum",
        tiny(train={"steps": 1, "global_batch": 4, "precision": "fp8"}),
        "train.precision",
        "bf16_fp32_adam",
    ),
    ("fault needs rank", tiny(faults=[{"kind": "kill_rank", "at_step": 1}]), "faults[0].rank", "required"),
    ("fault kind", tiny(faults=[{"kind": "meteor", "at_step": 1, "rank": 0}]), "faults[0].kind", "kill_rank"),
    ("NUL in name", tiny(name="a\x00b"), "name", "NUL"),
    ("tokens need a path", tiny(data={"kind": "tokens"}), "data.path", "required"),
    (
        "too many GPUs asked",
        tiny(parallelism={**TINY["parallelism"], "pp": 1, "cp": 1}, resources={"gpus": 8}),
        "parallelism",
        "must equal resources.gpus (8)",
    ),
    (
        "layout the engine refuses",
        tiny(parallelism={"tp": 3, "dp": 1, "micro_batch_size": 4}),
        "parallelism",
        "must divide model.heads",
    ),
]


@pytest.mark.parametrize("case", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_names_the_field(client: TestClient, tokens: dict[str, str], case: tuple) -> None:
    _, spec, field, words = case
    r = client.post("/v1/jobs", json=spec, headers=bearer(tokens["a"]))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    problem = r.json()
    assert problem["status"] == 422 and problem["title"] == "Invalid request"
    assert problem["instance"] == "/v1/jobs"
    fields = {e["field"]: e["message"] for e in problem["errors"]}
    assert field in fields, problem
    assert words in fields[field], problem
    assert field in problem["detail"]


def test_unparseable_bodies(client: TestClient, tokens: dict[str, str]) -> None:
    h = bearer(tokens["a"]) | {"content-type": "application/json"}
    for body in (b"{", b"[]", b'{"name": "x", "train": {"steps": NaN, "global_batch": 1}}', b"\xff\xfe"):
        r = client.post("/v1/jobs", content=body, headers=h)
        assert r.status_code == 422, (body, r.text)
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["errors"]
    deep = b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # valid JSON the parser cannot nest
    for path in ("/v1/jobs", "/v1/plans"):
        r = client.post(path, content=deep, headers=h)
        assert r.status_code == 422 and r.json()["detail"] == "body: the request body nests too deeply"


def test_bad_query_and_path_parameters(client: TestClient, tokens: dict[str, str]) -> None:
    h = bearer(tokens["a"])
    cases = [
        ("/v1/jobs", {"limit": 0}, "limit", "query"),
        ("/v1/jobs", {"state": "done"}, "state[0]", "query"),
        ("/v1/jobs", {"cursor": "not-a-cursor"}, "cursor", "query"),
        ("/v1/jobs/x/events", {"after": -1}, "after", "query"),
    ]
    for path, params, field, location in cases:
        r = client.get(path, params=params, headers=h)
        assert r.status_code == 422, (path, params)
        errors = r.json()["errors"]
        assert {"field": field, "location": location} == {k: errors[0][k] for k in ("field", "location")}, (
            errors
        )
    r = client.post("/v1/jobs", json=tiny(), headers=h | {"Idempotency-Key": "k" * 300})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "Idempotency-Key"


def test_unknown_job_and_route_are_404_problems(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.get("/v1/jobs/01ZZZZZZZZZZZZZZZZZZZZZZZZ", headers=bearer(tokens["a"]))
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["detail"] == "no route for GET /v1/nothing"
    r = client.delete("/v1/jobs")
    assert r.status_code == 405 and r.headers["content-type"] == "application/problem+json"


def test_fault_injection_is_mounted_and_off_by_default(client: TestClient, tokens: dict[str, str]) -> None:
    job = client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["a"])).json()
    fault = {"kind": "kill_rank", "rank": 0, "at_step": 1}
    r = client.post(f"/v1/jobs/{job['id']}/faults", json=fault, headers=bearer(tokens["a"]))
    assert r.status_code in (403, 404), r.text  # a user never injects faults
    r = client.post(f"/v1/jobs/{job['id']}/faults", json=fault, headers=bearer(tokens["admin"]))
    assert r.status_code == 409 and "LATTICE_FAULT_INJECTION" in r.json()["detail"], r.text


def test_every_limited_route_documents_429_and_503_with_retry_after(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path, item in paths.items():
        for operation in item.values():
            responses = operation["responses"]
            if path in ("/healthz", "/readyz", "/metrics"):  # probes are never shed or limited
                assert "429" not in responses, path
                continue
            for status in ("429", "503"):
                assert "Retry-After" in responses[status].get("headers", {}), (path, status)
