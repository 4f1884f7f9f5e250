"""POST /v1/plans fills in what the service knows: a request without a cluster is planned on the
service's own cluster, as a job is (its GPU type, size and node shape, and the precision a job on
that GPU type trains in), so a plan and a job of the same model and batch get the same layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from service.api.app import create_app
from service.settings import Settings
from tests.api.conftest import bearer


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    # two racks of two nodes of two virtual GPUs (8): not the default shape (16 GPUs, 4 a node), so a
    # default can be told apart
    return Settings(home=tmp_path / "home", database_url=db_url, embedded_racks=2, embedded_nodes_per_rack=2,
                    embedded_gpus_per_node=2)


@pytest.fixture
def app(settings: Settings, db_engine: Engine) -> FastAPI:
    return create_app(settings, engine=db_engine)


def _plan(client: TestClient, token: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/plans", json={"model": {"preset": "demo"}, "global_batch": 8, **body},
                    headers=bearer(token))
    assert r.status_code == 200, r.text
    return r.json()


def test_a_plan_without_a_cluster_is_the_plan_a_job_gets(client: TestClient, tokens: dict[str, str]) -> None:
    plan = _plan(client, tokens["a"], {})
    assert plan["cluster"] == {"gpu_type": "cpu-virtual", "num_gpus": 8}
    assert plan["train"]["precision"] == "fp32"  # what a job on cpu-virtual trains in
    spec = {"name": "same", "model": {"preset": "demo"}, "train": {"steps": 2, "global_batch": 8}}
    job = client.post("/v1/jobs", json=spec, headers=bearer(tokens["a"]))
    assert job.status_code == 201, job.text
    assert plan["layout"] == job.json()["plan"]["layout"]
    assert plan["predicted"] == pytest.approx(job.json()["plan"]["predicted"])
    # the node shape is the service's: two GPUs per node, so TP (inside a node) is at most 2
    assert plan["layout"]["tp"] <= 2


def test_a_layout_without_a_cluster_is_planned_on_its_own_world_size(
    client: TestClient, tokens: dict[str, str]
) -> None:
    plan = _plan(client, tokens["a"], {"layout": {"tp": 2, "pp": 2, "dp": 4}})
    assert plan["cluster"]["num_gpus"] == 16
    assert (plan["layout"]["tp"], plan["layout"]["pp"], plan["layout"]["dp"]) == (2, 2, 4)


def test_given_fields_win_and_another_gpu_type_keeps_its_own_defaults(
    client: TestClient, tokens: dict[str, str]
) -> None:
    plan = _plan(client, tokens["a"], {"cluster": {"gpu_type": "H100-80GB"}})
    assert plan["cluster"] == {"gpu_type": "H100-80GB", "num_gpus": 8}
    assert plan["train"]["precision"] == "bf16_fp32_adam"
    given = _plan(client, tokens["a"],
                  {"precision": "fp32", "cluster": {"gpu_type": "H100-80GB", "num_gpus": 16}})
    assert given["cluster"] == {"gpu_type": "H100-80GB", "num_gpus": 16}
    assert given["train"]["precision"] == "fp32"


def test_a_bad_model_without_a_cluster_is_a_422_naming_the_field(
    client: TestClient, tokens: dict[str, str]
) -> None:
    r = client.post("/v1/plans", json={"model": {"preset": "nope"}, "global_batch": 8,
                                       "layout": {"tp": 2, "pp": 2, "dp": 2}}, headers=bearer(tokens["a"]))
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert "model.preset" in r.json()["detail"], r.text


def test_an_empty_gpu_type_is_refused_not_defaulted(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.post("/v1/plans", json={"model": {"preset": "demo"}, "global_batch": 8,
                                       "cluster": {"gpu_type": ""}}, headers=bearer(tokens["a"]))
    assert r.status_code == 422 and "gpu_type" in r.json()["detail"], r.text
