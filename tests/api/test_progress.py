"""A job's progress, goodput and reason (service.progress, the scheduler's ingest and admission, the
public view), and the metrics that say the same: MFU, free GPUs, job_name/tenant labels."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from prometheus_client import generate_latest
from sqlalchemy.orm import Session, sessionmaker

from service import metrics, store
from service.auth import create_token
from service.progress import (
    GOODPUT_PARTS,
    advance,
    checkpoint_seconds,
    goodput,
    goodput_ratio,
    job_mfu,
    mfu_seconds,
)
from service.scheduler import admission, observer
from service.scheduler.ingest import write_snapshot
from service.schemas.views import JobPublic
from training.config.hardware import GPU_CATALOG
from training.config.layout import Layout
from workers.topology import Topology


def snap(job_state: str, step: int = 0, *, controller: str = "RUNNING", step_time: float | None = None,
         useful: float = 0.0, wall: float = 1.0, events: list[dict[str, Any]] | None = None,
         total: int = 100) -> dict[str, Any]:
    """A controller snapshot as workers.controller's machine reports it."""
    return {
        "state": controller, "job_state": job_state, "terminal": False, "events": events or [],
        "progress": {"step": step, "total_steps": total, "loss": 2.0 if step else None, "tokens_per_s": None,
                     "mfu": None, "step_time_s": step_time},
        "placement": [], "result": None, "reason": None,
        "faults": {"useful_step_seconds": useful, "wall_seconds": wall},
    }


# ---- the progress document and goodput (pure, a fake clock) --------------------------------------
def test_goodput_parts_add_up_to_the_wall_time_and_startup_is_its_own_part() -> None:
    created = 1000.0
    kw = {"created": created, "start": created + 4, "plan_mfu_seconds": None}
    doc = advance(None, state="starting", snap=snap("starting", controller="STARTING"), now=created + 10,
                  **kw)
    # ranks up, no step done yet: still start-up
    doc = advance(doc, state="running", snap=snap("running"), now=created + 12, **kw)
    assert doc["eta_s"] is None and doc["step_time_s"] is None  # no step timed yet
    doc = advance(doc, state="running", snap=snap("running", 2, step_time=0.5, useful=1.0),
                  now=created + 14, **kw)
    saved = checkpoint_seconds([{"kind": "checkpoint_saved", "seconds": 0.5}, {"kind": "restart"}])
    doc = advance(doc, state="running", snap=snap("running", 10, step_time=0.7, useful=5.0, wall=10),
                  now=created + 20, checkpoint_seconds=saved, **kw)
    assert doc["checkpoint"] == 0.5
    # a failure: the time until the first step after it is restarting, and the steps a restore
    # throws away leave the useful time (the controller's books drop them)
    doc = advance(doc, state="recovering", snap=snap("recovering", 10, controller="RECOVERING", step_time=0.7,
                                                     useful=5.0, wall=12), now=created + 22, **kw)
    doc = advance(doc, state="running", snap=snap("running", 10, step_time=0.7, useful=5.0, wall=15),
                  now=created + 25, **kw)
    assert doc["phase"] == "restarting"
    doc = advance(doc, state="running", snap=snap("running", 9, step_time=0.5, useful=4.0, wall=17),
                  now=created + 27, **kw)
    assert doc["phase"] == "running"

    parts = goodput(doc, created=created, end=created + 30)
    assert set(parts) == set(GOODPUT_PARTS)
    assert sum(parts.values()) == pytest.approx(30.0, abs=0.01)
    assert parts["queued_s"] == pytest.approx(4.0)
    assert parts["startup_s"] == pytest.approx(6 + 2 + 1)  # the first 2 steps' 1 s is running time
    assert parts["restarting_s"] == pytest.approx(3 + 1.5)
    assert parts["useful_s"] == pytest.approx(4.0)
    assert parts["checkpoint_s"] == pytest.approx(0.5)
    assert parts["lost_s"] == pytest.approx(1 + 6 + 2 + 0.5 + 3 - 4.0 - 0.5)
    # the ratio leaves queue and start-up out: a fault-free job's start-up is not lost time
    assert goodput_ratio(parts) == pytest.approx(4.0 / (30 - 4 - 9), abs=1e-4)
    # median of recent step times; ETA from it
    assert doc["step_time_s"] == pytest.approx(0.5)
    assert doc["eta_s"] == pytest.approx((100 - 9) * 0.5)


def test_a_job_that_never_started_spent_its_time_queued() -> None:
    parts = goodput(None, created=100.0, end=142.5)
    assert parts["queued_s"] == 42.5 and sum(parts.values()) == 42.5


def test_mfu_is_measured_or_derived_from_the_plan() -> None:
    assert job_mfu({"mfu": 0.4, "step_time_s": 2.0}, 0.1) == 0.4
    assert job_mfu({"mfu": None, "step_time_s": 2.0}, 0.1) == pytest.approx(0.05)
    assert job_mfu({"mfu": None, "step_time_s": None}, 0.1) is None
    assert job_mfu({"mfu": None, "step_time_s": 2.0}, None) is None


def test_a_job_measured_at_its_predicted_step_time_has_its_predicted_mfu() -> None:
    # The plan's peak (a calibrated profile's, here 7x the catalogue's cpu-virtual) is the one used:
    # a job measured 2x slower than predicted has half the predicted MFU, not 3.5x it.
    plan = {"predicted": {"mfu": 0.025, "step_time_s": 0.1}, "flops_per_step": 4e12,
            "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8}}
    assert job_mfu({"mfu": None, "step_time_s": 0.1}, mfu_seconds(plan)) == pytest.approx(0.025)
    assert job_mfu({"mfu": None, "step_time_s": 0.2}, mfu_seconds(plan)) == pytest.approx(0.0125)
    # A plan without a prediction: flops per step over the catalogue's peak.
    bare = {"flops_per_step": 4e12, "cluster": {"gpu_type": "H100-80GB", "num_gpus": 2}}
    assert mfu_seconds(bare) == pytest.approx(4e12 / (2 * GPU_CATALOG["H100-80GB"].peak_flops))


# ---- the ingest writes it; the API reads it; the metrics say the same ------------------------------
PLAN = {"layout": {"tp": 1, "pp": 1, "dp": 2}, "predicted": {"mfu": 0.3}, "flops_per_step": 4e12,
        "cluster": {"gpu_type": "H100-80GB", "num_gpus": 2}}


def _job(sf: sessionmaker[Session], state_path: tuple[str, ...] = ("queued", "starting")) -> str:
    with sf() as s:
        create_token(s, tenant="team-a")
        job = store.create_job(s, tenant="team-a", name="tiny-llm", spec={}, plan=PLAN, total_steps=100)
        for state in state_path:
            store.transition(s, job.id, state, reason="test")
        s.commit()
        return job.id


def _sample(name: str, **labels: str) -> float | None:
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def _view(sf: sessionmaker[Session], job_id: str) -> JobPublic:
    with sf() as s:
        return JobPublic.from_row(store.get_job(s, job_id))


def test_ingest_stores_progress_and_reason_and_the_metrics_match(
    db_session_factory: sessionmaker[Session],
) -> None:
    sf = db_session_factory
    job_id = _job(sf)
    assert _view(sf, job_id).reason == "starting: test"
    job_metrics = observer.observe_launch(job_id, PLAN)
    try:
        first = snap("running", 0, controller="RUNNING")
        write_snapshot(sf, job_id, 0, first, [])
        job_metrics.observe(first, [])
        view = _view(sf, job_id)
        assert view.state == "running" and view.reason == "starting: waiting for the first step"
        second = snap("running", 5, step_time=0.25, useful=1.25, wall=3.0)
        write_snapshot(sf, job_id, 0, second, [])
        job_metrics.observe(second, [])
        view = _view(sf, job_id)
        assert view.reason == "running"
        p = view.progress
        assert p.step == 5 and p.step_time_s == 0.25 and p.eta_s == pytest.approx(95 * 0.25)
        # no measured MFU on virtual GPUs: the plan's FLOPs over the step time, in the API and the metric
        assert p.mfu == pytest.approx(mfu_seconds(PLAN) / 0.25)
        assert _sample("lattice_job_mfu", job_id=job_id) == p.mfu
        labels = {"job_id": job_id, "job_name": "tiny-llm", "tenant": "team-a"}
        assert _sample("lattice_job_mfu_predicted", **labels) == 0.3
        assert _sample("lattice_job_goodput_seconds", job_id=job_id, part="startup") == pytest.approx(
            p.goodput.startup_s, abs=0.01)
        # the parts add up to the job's age when the view was built (between `before` and `after`;
        # each part rounded to the millisecond), however long this host took in between
        before = (dt.datetime.now(dt.UTC) - view.created_at).total_seconds()
        total = sum(_view(sf, job_id).progress.goodput.model_dump().values())
        after = (dt.datetime.now(dt.UTC) - view.created_at).total_seconds()
        assert before - 0.01 <= total <= after + 0.01, (before, total, after)

        failure = {"seq": 1, "kind": "failure", "message": "rank(s) [3] died: ActorDiedError",
                   "failure": {"kind": "rank_died", "ranks": [3], "nodes": ["r1-n2"]}}
        third = snap("recovering", 5, controller="RECOVERING", step_time=0.25, events=[failure])
        write_snapshot(sf, job_id, 0, third, [failure])
        job_metrics.observe(third, [failure])
        view = _view(sf, job_id)
        assert view.state == "recovering"
        assert view.reason == "recovering: rank(s) [3] died: ActorDiedError (on r1-n2)"
    finally:
        metrics.forget_job(job_id)
    assert f'job_id="{job_id}"' not in generate_latest(metrics.REGISTRY).decode()


def test_per_job_series_carry_job_name_and_tenant_and_restarts_start_at_zero() -> None:
    job_id = "labels-1"
    observer.publish(job_id, "llm-7b", "team-b", observer.Derived(0.2, dict.fromkeys(GOODPUT_PARTS, 1.0)))
    try:
        observer.JobMetrics(job_id).observe(snap("running", 3, step_time=0.1), [])
        text = generate_latest(metrics.REGISTRY).decode()
        series = [line for line in text.splitlines() if f'job_id="{job_id}"' in line]
        assert series and all('job_name="llm-7b"' in s and 'tenant="team-b"' in s for s in series)
        for cause in metrics.RESTART_CAUSES:
            assert _sample("lattice_job_restarts_total", job_id=job_id, cause=cause) == 0
    finally:
        metrics.forget_job(job_id)
    assert f'job_id="{job_id}"' not in generate_latest(metrics.REGISTRY).decode()


# ---- free GPUs and why a job waits ----------------------------------------------------------------
def test_no_free_gpus_on_a_cordoned_or_quarantined_node() -> None:
    topology = Topology.uniform(cordoned=["r1-n1"], health={"r1-n2": "quarantined"})
    observer.observe_cluster(topology)
    assert _sample("lattice_cluster_gpus_free", node="r1-n1") == 0
    assert _sample("lattice_cluster_gpus_free", node="r1-n2") == 0
    assert _sample("lattice_cluster_gpus_free", node="r2-n1") == 4
    assert _sample("lattice_cluster_gpus_total", node="r1-n1") == 4


def test_a_queued_job_says_what_it_waits_for(db_session_factory: sessionmaker[Session]) -> None:
    busy = Topology.uniform(used={"r1-n1": 2, "r1-n2": 1, "r2-n1": 3, "r2-n2": 4})
    layout = Layout(tp=4, dp=1)
    assert admission.waiting_reason(layout, busy, "placement says no").startswith("no node with 4 free GPUs")
    free = Topology.uniform(used={"r1-n1": 4, "r1-n2": 4, "r2-n1": 2})
    assert admission.waiting_reason(Layout(tp=2, dp=4), free, "x").startswith("needs 8 GPUs, 6 free")

    sf = db_session_factory
    job_id = _job(sf, ("queued",))
    notes = admission.WaitingNotes(sf, sf)
    notes.note(job_id, admission.waiting_reason(layout, busy, "placement says no"))
    view = _view(sf, job_id)
    assert view.state == "queued"
    assert view.reason.startswith("queued: no node with 4 free GPUs")
    assert view.progress.goodput.queued_s > 0 and view.progress.goodput.useful_s == 0


def test_validation_loss_is_kept_until_the_next_evaluation() -> None:
    created = 1000.0
    kw = {"created": created, "start": created, "plan_mfu_seconds": None}
    evaluated = snap("running", 4, step_time=0.5)
    evaluated["progress"].update(val_loss=3.25, val_step=4)
    doc = advance(None, state="running", snap=evaluated, now=created + 5, **kw)
    assert (doc["val_loss"], doc["val_step"]) == (3.25, 4)
    doc = advance(doc, state="running", snap=snap("running", 5, step_time=0.5), now=created + 6, **kw)
    assert (doc["val_loss"], doc["val_step"]) == (3.25, 4)  # a snapshot without one keeps the last
