"""A job's `parallelism` may be any subset of the layout's fields (the planner fills in the rest, as
`POST /v1/plans` and `lattice plan --layout` do); a fault without `at_step` fires at the next step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.api.app import create_app
from service.planner import ClusterSpec, TrainSpec, default_precision, get_preset, plan_layout
from service.schemas import JobSpec
from service.settings import Settings
from service.store.models import JobState
from tests.api.conftest import bearer
from training.config.layout import Layout
from training.config.validate import check_layout_for_model


def demo_job(parallelism: Any, **extra: Any) -> dict[str, Any]:
    return {
        "name": "partial",
        "model": {"preset": "demo"},
        "train": {"steps": 4, "global_batch": 8},
        "parallelism": parallelism,
        **extra,
    }


def test_the_issue_example_is_accepted_and_planned(
    client: TestClient, tokens: dict[str, str], settings: Settings
) -> None:
    r = client.post("/v1/jobs", json=demo_job({"tp": 2, "pp": 2, "dp": 2}), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["spec"]["parallelism"]["tp"] == 2 and job["spec"]["parallelism"].get("schedule") is None
    plan = job["plan"]
    layout = Layout.from_dict(plan["layout"])
    assert (layout.tp, layout.pp, layout.dp, layout.global_batch) == (2, 2, 2, 8)
    check_layout_for_model(get_preset("demo"), layout)
    assert plan["given"] == {"tp": 2, "pp": 2, "dp": 2}
    assert any(r.startswith(f"schedule: chose {layout.schedule} (pp=2 given") for r in plan["reasons"])
    # The same fill-in as the planner called directly (and so as POST /v1/plans and `lattice plan`).
    cluster = ClusterSpec(
        settings.gpu_type, 8, settings.embedded_gpus_per_node, settings.embedded_nodes_per_rack
    )
    train = TrainSpec(8, 64, precision=default_precision(settings.gpu_type))  # fp32 on the CPU cluster
    direct = plan_layout(get_preset("demo"), train, cluster, {"tp": 2, "pp": 2, "dp": 2})
    assert plan["layout"] == direct.to_dict()["layout"]
    # The stored spec validates back to the same partial layout (the scheduler re-reads it).
    assert JobSpec.model_validate(job["spec"]).layout_given() == {"tp": 2, "pp": 2, "dp": 2}


def test_a_missing_degree_comes_from_the_cluster(client: TestClient, tokens: dict[str, str]) -> None:
    r = client.post("/v1/jobs", json=demo_job({"tp": 2, "pp": 2}, resources={"gpus": 8}),
                    headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    lay = r.json()["plan"]["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (2, 2, 2)
    expected = "dp: chose 2 (8 GPUs / (tp=2 given x cp=1 chosen x pp=2 given); the fastest predicted split)"
    assert expected in r.json()["plan"]["reasons"]


def test_an_impossible_layout_is_a_422_naming_parallelism_and_the_nearest(
    client: TestClient, tokens: dict[str, str]
) -> None:
    r = client.post("/v1/jobs", json=demo_job({"tp": 4, "pp": 2}, resources={"gpus": 8}),
                    headers=bearer(tokens["a"]))
    assert r.status_code == 422, r.text
    problem = r.json()
    assert r.headers["content-type"] == "application/problem+json"
    message = {e["field"]: e["message"] for e in problem["errors"]}["parallelism"]
    assert "tp=4,pp=2 cannot work: parallelism.tp (4) must divide model.kv_heads (2)" in message
    assert "the nearest layout that works is tp=2,pp=2,dp=2" in message
    assert "(keeps pp=2; the nearest values that work: tp=2 (given 4))" in message
    assert "parallelism" in problem["detail"]
    assert client.get("/v1/jobs", headers=bearer(tokens["a"])).json()["items"] == []  # nothing stored


def test_auto_and_a_complete_layout_work_as_before(client: TestClient, tokens: dict[str, str]) -> None:
    auto = client.post("/v1/jobs", json=demo_job("auto"), headers=bearer(tokens["a"]))
    assert auto.status_code == 201 and auto.json()["plan"]["mode"] == "search"
    complete = auto.json()["plan"]["layout"]
    r = client.post("/v1/jobs", json=demo_job(complete), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    assert r.json()["plan"]["mode"] == "evaluate" and r.json()["plan"]["layout"] == complete


# ---- faults without at_step --------------------------------------------------------------------------
class _Controller:
    def __init__(self) -> None:
        self.faults: list[dict[str, Any]] = []

    def inject_fault(self, fault: dict[str, Any], timeout_s: float) -> None:
        self.faults.append(fault)


@pytest.fixture
def fault_client(db_url: str, tmp_path: Path, db_engine: Engine) -> Iterator[TestClient]:
    app: FastAPI = create_app(Settings(home=tmp_path / "home", database_url=db_url, fault_injection=True),
                              engine=db_engine)
    with TestClient(app) as c:
        yield c


def test_a_fault_without_at_step_fires_at_the_next_step(
    fault_client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import workers.client

    controller = _Controller()
    monkeypatch.setattr(workers.client, "is_connected", lambda: True)
    monkeypatch.setattr(workers.client, "find_controller", lambda job_id: controller)
    admin = bearer(tokens["admin"])
    spec = demo_job({"tp": 2, "pp": 2, "dp": 2}, faults=[{"kind": "kill_rank", "rank": 1}])
    r = fault_client.post("/v1/jobs", json=spec, headers=admin)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert r.json()["spec"]["faults"][0]["at_step"] == 1  # a spec fault of a job not yet started: step 1
    with store.session_scope(db_session_factory) as s:
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING):
            store.transition(s, job_id, state)
        store.update_progress(s, job_id, step=7)
    r = fault_client.post(f"/v1/jobs/{job_id}/faults", json={"kind": "kill_rank", "rank": 1}, headers=admin)
    assert r.status_code == 202, r.text
    assert r.json()["fault"]["at_step"] == 8
    assert controller.faults == [r.json()["fault"]]
    r = fault_client.post(f"/v1/jobs/{job_id}/faults", json={"kind": "kill_rank", "rank": 0, "at_step": 20},
                          headers=admin)
    assert r.status_code == 202 and r.json()["fault"]["at_step"] == 20  # a given at_step is kept


def test_the_scheduler_replans_a_partial_layout_keeping_its_fields(
    db_session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    from service.api.operations import plan_job
    from service.scheduler.admission import admit_pending
    from workers.topology import Topology

    settings = Settings(home=tmp_path, gpu_type="cpu-virtual")
    spec = JobSpec.model_validate(demo_job({"tp": 2, "pp": 2, "dp": 2}, resources={"gpu_type": "H100"}))
    with store.session_scope(db_session_factory) as s:
        store.ensure_tenant(s, "t")
        job = store.create_job(s, tenant="t", name="p", spec=spec.canonical(), plan=plan_job(spec, settings))
        assert job.plan["cluster"]["gpu_type"] != "cpu-virtual"
    admit_pending(db_session_factory, db_session_factory, settings, Topology.uniform(2, 2, 4))
    with db_session_factory() as s:
        plan = store.get_job(s, job.id).plan
    assert plan["cluster"] == {"gpu_type": "cpu-virtual", "num_gpus": 8}
    assert (plan["layout"]["tp"], plan["layout"]["pp"], plan["layout"]["dp"]) == (2, 2, 2)
    assert plan["given"] == {"tp": 2, "pp": 2, "dp": 2} and plan["layout"]["schedule"] != "none"


def test_a_plans_layout_line_pasted_as_parallelism_runs_that_layout(
    client: TestClient, tokens: dict[str, str]
) -> None:
    from service.planner.result import describe

    planned = client.post("/v1/plans", json={"model": {"preset": "demo"}, "global_batch": 8},
                          headers=bearer(tokens["a"]))
    assert planned.status_code == 200, planned.text
    line = describe(Layout.from_dict(planned.json()["layout"]))  # what `lattice plan` prints
    r = client.post("/v1/jobs", json=demo_job(line), headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    assert r.json()["plan"]["layout"] == planned.json()["layout"]
    stored = r.json()["spec"]["parallelism"]  # stored as the object, so the scheduler reads it as ever
    assert isinstance(stored, dict) and stored["tp"] == planned.json()["layout"]["tp"]
    partial = client.post("/v1/jobs", json=demo_job("tp=2,pp=2"), headers=bearer(tokens["a"]))
    assert partial.status_code == 201, partial.text
    assert partial.json()["plan"]["given"] == {"tp": 2, "pp": 2}


@pytest.mark.parametrize("line, needle", [("tp=abc", "tp must be an integer"), ("tp=2,tp=4", "given twice"),
                                          ("bogus=1", "unknown field 'bogus'"), ("  ", "layout line"),
                                          ("schedule=sideways", "parallelism.schedule")])
def test_a_bad_layout_line_is_a_422_naming_parallelism(
    client: TestClient, tokens: dict[str, str], line: str, needle: str
) -> None:
    r = client.post("/v1/jobs", json=demo_job(line), headers=bearer(tokens["a"]))
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"] and "parallelism" in r.json()["detail"], r.text
