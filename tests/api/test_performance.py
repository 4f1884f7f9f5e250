"""Predicted vs measured (issue 16): the ingest keeps the ranks' medians after warm-up next to the
plan's prediction, the API and `lattice status` show both with the ratio, a step time far off the
prediction raises one `plan_mismatch` event, a fault-free finished job feeds the planner, and
`lattice plan --explain-against JOB` prints the time per term."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from service import metrics, store
from service.auth import create_token
from service.cli import app as cli_app
from service.cli import plan as cli_plan
from service.cli.client import Client
from service.cli.job_views import status_table
from service.performance import PLAN_MISMATCH_EVENT, mismatch, performance
from service.scheduler import observer
from service.scheduler.ingest import write_snapshot
from service.scheduler.learning import FEEDBACK_EVENT
from service.schemas.views import JobPublic

TERMS = {"compute": 0.060, "recompute": 0.0, "tp": 0.010, "cp": 0.0, "ep": 0.0, "pp_p2p": 0.0,
         "bubble": 0.0, "dp_exposed": 0.020, "optimizer": 0.010}
PLAN: dict[str, Any] = {
    "layout": {"tp": 2, "pp": 1, "dp": 2, "cp": 1, "zero_stage": 1},
    "predicted": {"step_time_s": 0.1, "mfu": 0.3, "tokens_per_s": 2560.0, "tflops_per_gpu": 1.0},
    "time_breakdown_s": TERMS, "flops_per_step": 4e12, "train": {"global_batch": 4, "seq_len": 64},
    "cluster": {"gpu_type": "H100-80GB", "num_gpus": 4}, "profile": None,
}
PHASES = {"data": 0.001, "compute": 0.09, "integrity": 0.001, "dp_sync": 0.03, "optimizer": 0.012,
          "summary": 0.002}


def snap(job_state: str, step: int, perf: dict[str, Any] | None, *, terminal: bool = False) -> dict[str, Any]:
    progress = {"step": step, "total_steps": 20, "loss": 2.0, "tokens_per_s": None, "mfu": None,
                "step_time_s": (perf or {}).get("step_time_s")}
    if perf is not None:
        progress["perf"] = perf
    return {"state": "FINISHED" if terminal else "RUNNING", "job_state": job_state, "terminal": terminal,
            "events": [], "progress": progress, "placement": [], "result": {} if terminal else None,
            "reason": None, "faults": {"useful_step_seconds": 1.0, "wall_seconds": 2.0}}


def perf(step_time: float, steps: int = 8) -> dict[str, Any]:
    """The controller's summary (workers.controller.perf) of `steps` steps after warm-up."""
    return {"steps": steps, "warmup_steps": 3, "source": "rank 0", "step_time_s": step_time,
            "phases_s": PHASES}


def _job(sf: sessionmaker[Session]) -> str:
    with sf() as s:
        create_token(s, tenant="team-a")
        job = store.create_job(s, tenant="team-a", name="tiny", spec={}, plan=PLAN, total_steps=20)
        for state in ("queued", "starting"):
            store.transition(s, job.id, state, reason="test")
        s.commit()
        return job.id


def _events(sf: sessionmaker[Session], job_id: str, kind: str) -> list[dict[str, Any]]:
    with sf() as s:
        return [e.payload for e in store.list_events(s, job_id, limit=None, types=[kind])]


def _run(sf: sessionmaker[Session], job_id: str, step_times: list[float], *, finish: bool = True,
         events: list[dict[str, Any]] | None = None) -> None:
    for i, t in enumerate(step_times):
        write_snapshot(sf, job_id, 0, snap("running", 4 + i, perf(t, 1 + i)), events or [] if i == 0 else [])
    if finish:
        write_snapshot(sf, job_id, 0, snap("succeeded", 20, perf(step_times[-1], 16), terminal=True), [])


class ApiClient(Client):
    """The CLI's client over the API's test client."""

    def __init__(self, http: TestClient) -> None:
        self.server, self._http = "http://testserver", http


def _sample(name: str, job_id: str) -> float | None:
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels.get("job_id") == job_id:
                return sample.value
    return None


# ---- pure -------------------------------------------------------------------------------------------
def test_performance_puts_measured_next_to_predicted_with_the_terms() -> None:
    doc = {"perf": perf(0.14)}
    p = performance(PLAN, doc)
    assert p is not None
    assert p["ratio"] == pytest.approx(1.4)
    assert p["measured"]["tokens_per_s"] == pytest.approx(4 * 64 / 0.14)
    rows = {r["term"]: r for r in p["terms"]}
    assert rows["dp_exposed"]["measured_s"] == 0.03 and rows["optimizer"]["measured_s"] == 0.012
    # TP runs inside forward + backward: the compute row compares as a group, TP is not separable
    assert rows["compute"]["measured_s"] is None and "not separable" in rows["tp"]["note"]
    assert "not separately measurable" in rows["recompute"]["note"]
    assert rows["forward_backward"]["predicted_s"] == pytest.approx(0.07)
    assert rows["forward_backward"]["measured_s"] == 0.09
    assert rows["other"]["measured_s"] == pytest.approx(0.14 - 0.09 - 0.03 - 0.012)
    assert performance(PLAN, {})["measured"] is None  # type: ignore[index]
    assert performance(None, doc) is None


@pytest.mark.parametrize(("measured", "fires"), [(0.1, False), (0.14, False), (0.07, False), (0.16, True),
                                                 (0.06, True)])
def test_mismatch_fires_beyond_one_and_a_half_times_either_way(measured: float, fires: bool) -> None:
    found = mismatch(performance(PLAN, {"perf": perf(measured)}))
    assert (found is not None) == fires
    if found:
        assert found["biggest_term"] == "compute" and "compute" in found["message"]
    assert mismatch(performance(PLAN, {"perf": perf(1.0, steps=2)})) is None  # too few steps yet


# ---- the ingest, the API, the metrics, the CLI ------------------------------------------------------
def test_ingest_stores_both_and_the_view_status_and_metrics_show_them(
    db_session_factory: sessionmaker[Session],
) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    jm = observer.observe_launch(job_id, PLAN)
    try:
        s = snap("running", 6, perf(0.12))
        write_snapshot(sf, job_id, 0, s, [])
        jm.observe(s, [])
        with sf() as session:
            view = JobPublic.from_row(store.get_job(session, job_id)).model_dump(mode="json")
        assert view["performance"]["measured"]["step_time_s"] == 0.12
        assert view["performance"]["predicted"]["step_time_s"] == 0.1
        assert view["performance"]["ratio"] == pytest.approx(1.2)
        assert _sample("lattice_job_step_seconds_predicted", job_id) == 0.1
        assert _sample("lattice_job_step_seconds_median", job_id) == 0.12
    finally:
        metrics.forget_job(job_id)
    console = Console(width=100, record=True, file=open("/dev/null", "w"))
    console.print(status_table(view, wide=False))
    text = console.export_text()
    assert "predicted  100 ms/step, 2,560 tok/s, MFU 30.00%" in text
    assert "measured   120 ms/step" in text and "(1.20x predicted; median of 8 steps after warm-up)" in text
    assert _events(sf, job_id, PLAN_MISMATCH_EVENT) == []  # 1.2x: close enough


def test_plan_mismatch_fires_once_naming_the_biggest_term(db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    _run(sf, job_id, [0.12, 0.3, 0.31, 0.32], finish=False)
    found = _events(sf, job_id, PLAN_MISMATCH_EVENT)
    assert len(found) == 1
    # first called at the third step after warm-up (MIN_MEASURED_STEPS), not again after it
    assert found[0]["biggest_term"] == "compute" and found[0]["ratio"] == pytest.approx(3.1)


def test_a_finished_job_without_faults_feeds_the_planner(db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    _run(sf, job_id, [0.2, 0.2])
    (fed,) = _events(sf, job_id, FEEDBACK_EVENT)
    assert fed["factor"] < 1.0  # slower than predicted: the compute efficiency goes down...
    assert 0.1 < fed["predicted_after_s"] < 0.2  # ...toward the measurement, never past it
    with sf() as s:
        assert store.get_job(s, job_id).state == "succeeded"


def test_a_job_with_faults_teaches_nothing(db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    failure = {"seq": 1, "kind": "failure", "message": "rank(s) [1] died",
               "failure": {"kind": "rank_died", "ranks": [1], "nodes": []}}
    _run(sf, job_id, [0.2, 0.2], events=[failure])
    assert _events(sf, job_id, FEEDBACK_EVENT) == []


def test_feedback_can_be_switched_off(db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    write_snapshot(sf, job_id, 0, snap("running", 6, perf(0.2)), [])
    write_snapshot(sf, job_id, 0, snap("succeeded", 20, perf(0.2), terminal=True), [], feedback=False)
    assert _events(sf, job_id, FEEDBACK_EVENT) == []


def test_explain_against_prints_the_terms_of_a_finished_job(
    db_session_factory: sessionmaker[Session], client: TestClient, tokens: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sf = db_session_factory
    with sf() as s:
        job = store.create_job(s, tenant="team-a", name="tiny", spec={}, plan=PLAN, total_steps=20)
        for state in ("queued", "starting"):
            store.transition(s, job.id, state, reason="test")
        s.commit()
        job_id = job.id
    _run(sf, job_id, [0.14, 0.14])
    client.headers["Authorization"] = f"Bearer {tokens['a']}"
    cli = ApiClient(client)
    monkeypatch.setattr(cli_plan, "client_for", lambda ctx: cli)
    monkeypatch.setenv("COLUMNS", "160")
    result = CliRunner().invoke(cli_app, ["plan", "--explain-against", job_id])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "1.40x the prediction" in out
    for name in ("compute", "exposed TP", "exposed DP", "recompute", "optimizer", "forward + backward"):
        assert name in out
    assert "30 ms" in out and "12 ms" in out  # measured DP sync wait and optimizer step
    assert "not separately measurable" in out

    # a job with nothing measured: one line, exit code 1
    with sf() as s:
        other = store.create_job(s, tenant="team-a", name="idle", spec={}, plan=PLAN, total_steps=20)
        s.commit()
    result = CliRunner().invoke(cli_app, ["plan", "--explain-against", other.id])
    assert result.exit_code == 1 and "no measured step" in result.output


def test_feedback_stores_the_next_version_of_the_profile_the_plan_used(
    db_session_factory: sessionmaker[Session],
) -> None:
    from service.store import profiles

    sf = db_session_factory
    doc = {"node_type": "H100-80GB", "compute_dtype": "bf16", "matmul": {"bf16": [[1024, 1024, 1024, 5e14]]},
           "attention": [[2048, 128, 3e14]], "memory_bw": 3e12}
    with sf() as s:
        first = profiles.save_profile(s, doc)
        s.commit()
    plan = {**PLAN, "profile": first.ref}
    with sf() as s:
        create_token(s, tenant="team-a")
        job = store.create_job(s, tenant="team-a", name="tiny", spec={}, plan=plan, total_steps=20)
        for state in ("queued", "starting"):
            store.transition(s, job.id, state, reason="test")
        s.commit()
        job_id = job.id
    _run(sf, job_id, [0.2, 0.2])
    (fed,) = _events(sf, job_id, FEEDBACK_EVENT)
    assert fed["profile"] == first.ref and fed["new_version"] == first.version + 1
    with sf() as s:
        newest = profiles.newest_profile(s, "H100-80GB")
    assert newest is not None and newest.version == first.version + 1
    assert newest.matmul["bf16"][0][3] == pytest.approx(5e14 * fed["factor"])
    assert newest.attention[0][2] == pytest.approx(3e14 * fed["factor"])
    assert newest.meta["feedback"][-1]["job_id"] == job_id
