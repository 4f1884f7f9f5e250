"""POST /v1/plans on a bare FastAPI app with the planner's router."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.routes.plans import router
from service.planner import ClusterSpec, TrainSpec, get_preset, plan

# Every field given: the service's own cluster and precision fill in only what a request leaves out
# (tests/api/test_plan_defaults.py).
DEMO = {
    "model": {"preset": "demo"},
    "global_batch": 8,
    "precision": "bf16_fp32_adam",
    "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8, "gpus_per_node": 4, "nodes_per_rack": 4},
}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def test_plan_returns_the_plan_json(client: TestClient):
    r = client.post("/v1/plans", json=DEMO)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body["layout"]) >= {
        "tp",
        "pp",
        "dp",
        "cp",
        "zero_stage",
        "micro_batch_size",
        "num_microbatches",
        "schedule",
        "sequence_parallel",
        "recompute",
    }
    assert set(body["memory_per_gpu_bytes"]) >= {
        "params",
        "grads",
        "optimizer",
        "activations",
        "total",
        "capacity",
    }
    assert set(body["predicted"]) == {"step_time_s", "mfu", "tokens_per_s", "tflops_per_gpu"}
    assert set(body["comm_bytes_per_step"]) >= {"tp", "pp", "dp", "cp"}
    assert isinstance(body["alternatives"], list) and isinstance(body["reasons"], list) and body["reasons"]
    assert body["flops_per_step"] > 0 and 0 <= body["bubble_fraction"] < 1
    direct = plan(get_preset("demo"), TrainSpec(8, 64), ClusterSpec("cpu-virtual", 8, 4)).to_dict()
    assert body["layout"] == direct["layout"]
    assert body["predicted"] == pytest.approx(direct["predicted"])


def test_evaluate_mode_matches_the_search(client: TestClient):
    searched = client.post("/v1/plans", json=DEMO).json()
    r = client.post("/v1/plans", json={**DEMO, "layout": searched["layout"]})
    assert r.status_code == 200, r.text
    assert r.json()["mode"] == "evaluate"
    assert r.json()["predicted"]["step_time_s"] == searched["predicted"]["step_time_s"]


def test_an_hsdp_layout_is_evaluated_and_a_bad_one_names_dp_replicate(client: TestClient):
    layout = {"dp": 8, "zero_stage": 3, "dp_replicate": 2, "micro_batch_size": 1, "num_microbatches": 1}
    r = client.post("/v1/plans", json={**DEMO, "layout": layout})
    assert r.status_code == 200, r.text
    assert r.json()["layout"]["dp_replicate"] == 2
    bad = client.post("/v1/plans", json={**DEMO, "layout": {**layout, "dp_replicate": 3}})
    assert bad.status_code == 422 and "dp_replicate" in bad.text, bad.text


def test_explicit_model_fields_and_seq_len_default(client: TestClient):
    body = {
        "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
        "global_batch": 8,
        "cluster": {"gpu_type": "H100-80GB", "num_gpus": 8},
        "zero_stages": [0, 1],
    }
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["train"]["seq_len"] == 32
    assert r.json()["layout"]["zero_stage"] in (0, 1)


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"cluster": {"gpu_type": "Z100", "num_gpus": 8}}, "cluster.gpu_type"),
        ({"model": {"preset": "nope"}}, "model.preset"),
        ({"model": {"layers": 2, "hidden": 64, "heads": 3, "vocab": 10, "seq_len": 8}}, "model.heads"),
        ({"model": {"hidden": 64}}, "missing: layers"),
        ({"global_batch": 3, "cluster": {"gpu_type": "H100-80GB", "num_gpus": 64}}, "global batch"),
        (
            {"model": {"preset": "llama3-405b"}, "cluster": {"gpu_type": "H100-80GB", "num_gpus": 8}},
            "smallest",
        ),
        ({"layout": {"tp": 4}}, "layout"),
    ],
)
def test_planner_errors_are_422_naming_the_field(client: TestClient, change: dict, needle: str):
    r = client.post("/v1/plans", json={**DEMO, **change})
    assert r.status_code == 422
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"layers": 0, "hidden": 64, "heads": 4, "vocab": 10, "seq_len": 8}},
        {"global_batch": 0},
        {"cluster": {"gpu_type": "H100-80GB", "num_gpus": 8, "oversubscription": 0.5}},
        {"zero_stages": [0, 7]},
        {"unexpected": 1},
    ],
)
def test_schema_violations_are_422(client: TestClient, change: dict):
    assert client.post("/v1/plans", json={**DEMO, **change}).status_code == 422
