"""Hot spares through the service: `fault_tolerance.spares` (or LATTICE_SPARES_PER_JOB) reaches the
controller, `GET /v1/cluster` lists the running jobs' spares (the job only to admins), the metrics
carry their count, age and the time to a warm replacement, and quotas count the job's ranks only."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service import metrics
from service.scheduler import admission
from service.scheduler.observer import JobMetrics
from service.schemas import JobSpec
from service.settings import Settings
from service.store.models import Job
from tests.api.conftest import bearer
from tests.api.specs import tiny
from training.config.layout import Layout

SPARES = [{"job": "sp-job", "node": "r1-n2", "rack": "r1", "state": "warm", "age_s": 12.5, "pid": 7},
          {"job": "sp-job", "node": "r2-n1", "rack": "r2", "state": "starting", "age_s": 0.4, "pid": None}]


class _Scheduler:
    def cluster_view(self) -> tuple[None, None]:
        return None, None

    def spares_view(self) -> list[dict[str, Any]]:
        return [dict(s) for s in SPARES]


def test_cluster_lists_the_spares_and_names_their_jobs_only_to_admins(
    app: FastAPI, client: TestClient, tokens: dict[str, str]
) -> None:
    assert client.get("/v1/cluster", headers=bearer(tokens["a"])).json()["spares"] == []
    app.state.scheduler = _Scheduler()
    shown = client.get("/v1/cluster", headers=bearer(tokens["admin"])).json()["spares"]
    assert [(s["job"], s["node"], s["state"], s["age_s"]) for s in shown] == [
        ("sp-job", "r1-n2", "warm", 12.5), ("sp-job", "r2-n1", "starting", 0.4)]
    user = client.get("/v1/cluster", headers=bearer(tokens["a"])).json()["spares"]
    assert [s["job"] for s in user] == [None, None] and [s["node"] for s in user] == ["r1-n2", "r2-n1"]


def test_spares_come_from_the_spec_or_the_service_default_and_are_bounded() -> None:
    spec = JobSpec.model_validate(tiny())
    assert admission.controller_options(Settings(), spec, 0, 0, {}).spares == 0
    assert admission.controller_options(Settings(spares_per_job=2), spec, 0, 0, {}).spares == 2
    own = JobSpec.model_validate(tiny(fault_tolerance={"spares": 1}))
    assert admission.controller_options(Settings(spares_per_job=2), own, 0, 0, {}).spares == 1
    with pytest.raises(ValidationError, match="spares"):
        JobSpec.model_validate(tiny(fault_tolerance={"spares": 65}))


def test_spares_do_not_count_against_the_tenant_quota() -> None:
    layout = Layout(tp=2, dp=2)
    job = Job(id="sp-quota", tenant="team-a", spec=tiny(fault_tolerance={"spares": 4}), progress={})
    assert admission._running(job, layout, time.time()).gpus == layout.world_size  # noqa: SLF001


def _sample(name: str, job_id: str, **labels: str) -> float:
    for family in metrics.REGISTRY.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("job_id") == job_id and labels.items() <= s.labels.items():
                return s.value
    raise AssertionError(f"{name}{{job_id={job_id}, {labels}}} not exposed")


def test_spare_metrics_follow_the_snapshots_and_leave_with_the_job() -> None:
    job = "sp-metrics"
    metrics.name_job(job, "sp", "team-a")
    observer = JobMetrics(job)
    restart = {"seq": 3, "kind": "restart", "path": "fast", "spare_used": True, "replacement_s": 0.05}
    observer.observe({"progress": {"step": 4}, "spares": SPARES, "warm_processes": {"n1": 1, "n2": 2}},
                     [restart])
    assert _sample("lattice_warm_processes", job) == 3
    assert _sample("lattice_spares", job, state="warm") == 1
    assert _sample("lattice_spares", job, state="starting") == 1
    assert _sample("lattice_spare_age_seconds", job) == 12.5
    assert _sample("lattice_job_replacement_seconds_count", job, spare="true") == 1
    assert observer.spares == SPARES
    observer.observe({"progress": {"step": 5}, "spares": []}, [])
    assert _sample("lattice_warm_processes", job) == 0
    assert _sample("lattice_spares", job, state="warm") == 0
    assert _sample("lattice_spare_age_seconds", job) == 0
    metrics.forget_job(job)
    with pytest.raises(AssertionError):
        _sample("lattice_spares", job)
    with pytest.raises(AssertionError):
        _sample("lattice_warm_processes", job)


def test_warm_worker_processes_per_node_come_from_the_service_setting_and_are_bounded() -> None:
    spec = JobSpec.model_validate(tiny())
    assert admission.controller_options(Settings(), spec, 0, 0, {}).warm_workers == 1
    assert admission.controller_options(Settings(warm_workers_per_node=0), spec, 0, 0, {}).warm_workers == 0
    with pytest.raises(ValidationError, match="warm_workers_per_node"):
        Settings(warm_workers_per_node=9)


@pytest.mark.parametrize(("gpu_type", "setting", "kept"), [
    ("cpu-virtual", "auto", False),  # the ranks compute on the host's cores: no standby imports
    ("H100-80GB", "auto", True),
    ("cpu-virtual", "on", True),
    ("H100-80GB", "off", False),
])
def test_warm_processes_on_standby_nodes_follow_the_node_type_unless_set(gpu_type, setting, kept) -> None:
    spec = JobSpec.model_validate(tiny())
    settings = Settings(gpu_type=gpu_type, warm_standby=setting)
    assert admission.controller_options(settings, spec, 0, 0, {}).warm_standby is kept
    with pytest.raises(ValidationError, match="warm_standby"):
        Settings(warm_standby="sometimes")
