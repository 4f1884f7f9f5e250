"""Measured hardware profiles through the API: `GET /v1/cluster` shows the newest per node type, and
plans (`POST /v1/plans`, a job's plan) on that node type use it and say which version."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service.store.profiles import save_profile
from tests.api.conftest import bearer
from tests.api.specs import tiny

PLAN_BODY = {"model": {"preset": "demo"}, "global_batch": 8,
             "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8, "gpus_per_node": 4}}  # fmt: skip


def _doc(rate: float) -> dict:
    return {
        "node_type": "cpu-virtual", "compute_dtype": "fp32",
        "matmul": {"fp32": [[32, 32, 32, rate / 8], [128, 128, 128, rate / 2], [512, 512, 512, rate]]},
        "attention": [[64, 16, rate / 10], [256, 16, rate / 4]], "memory_bw": 8e9,
        "collectives": {"all_reduce": [[4096.0, 2e-4], [1048576.0, 1.2e-3]]}, "ranks": 2, "backend": "gloo",
    }  # fmt: skip


def _save(factory: sessionmaker[Session], rate: float) -> None:
    with factory() as s:
        save_profile(s, _doc(rate))
        s.commit()


def test_cluster_shows_profiles_and_plans_use_the_newest(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    auth = bearer(tokens["a"])
    assert client.get("/v1/cluster", headers=auth).json()["profiles"] == []
    before = client.post("/v1/plans", json=PLAN_BODY, headers=auth).json()
    assert before["profile"] is None

    _save(db_session_factory, 5e9)
    (shown,) = client.get("/v1/cluster", headers=auth).json()["profiles"]
    assert (shown["node_type"], shown["version"], shown["backend"]) == ("cpu-virtual", 1, "gloo")
    v1 = client.post("/v1/plans", json=PLAN_BODY, headers=auth).json()
    assert v1["profile"] == {"node_type": "cpu-virtual", "version": 1}

    _save(db_session_factory, 20e9)  # a faster machine measured: version 2
    v2 = client.post("/v1/plans", json=PLAN_BODY, headers=auth).json()
    assert v2["profile"] == {"node_type": "cpu-virtual", "version": 2}
    assert v2["time_breakdown_s"]["compute"] < v1["time_breakdown_s"]["compute"]
    assert client.get("/v1/cluster", headers=auth).json()["profiles"][0]["version"] == 2

    # Another GPU type has no profile: the catalogue's curves.
    h100 = {**PLAN_BODY, "cluster": {"gpu_type": "H100", "num_gpus": 8}}
    assert client.post("/v1/plans", json=h100, headers=auth).json()["profile"] is None


def test_a_submitted_job_is_planned_with_the_profile(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    _save(db_session_factory, 5e9)
    job = client.post("/v1/jobs", json=tiny(), headers=bearer(tokens["a"]))
    assert job.status_code in (200, 201), job.text
    assert job.json()["plan"]["profile"] == {"node_type": "cpu-virtual", "version": 1}  # the default gpu_type


def test_a_cpu_profiles_oversubscription_is_shown_and_slows_an_8_rank_plans_compute(
    client: TestClient, tokens: dict[str, str], db_session_factory: sessionmaker[Session]
) -> None:
    auth = bearer(tokens["a"])
    cpu = {**_doc(5e9), "meta": {"device": "cpu", "threads": 1, "cores": 2}}
    over = {"ops": [[2.0, 1.25], [4.0, 1.35]], "matmul": [[2.0, 1.1], [4.0, 1.2]]}
    with db_session_factory() as s:
        save_profile(s, cpu)
        s.commit()
    ideal = client.post("/v1/plans", json=PLAN_BODY, headers=auth).json()
    with db_session_factory() as s:
        save_profile(s, {**cpu, "oversubscription": over})  # the same host, its oversubscription measured
        s.commit()
    (shown,) = client.get("/v1/cluster", headers=auth).json()["profiles"]
    assert shown["version"] == 2 and shown["oversubscription"] == over
    crowded = client.post("/v1/plans", json=PLAN_BODY, headers=auth).json()
    assert crowded["profile"] == {"node_type": "cpu-virtual", "version": 2}
    assert crowded["time_breakdown_s"]["compute"] > 1.1 * ideal["time_breakdown_s"]["compute"]
