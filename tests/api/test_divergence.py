"""A diverged job (service.scheduler.divergence): one `loss_diverged` warning event once its loss is
worse than a uniform guess over the vocabulary; the job is not failed for it, and a healthy loss (or a
job whose spec names no model) raises none."""

from __future__ import annotations

import math

from rich.console import Console
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.auth import create_token
from service.cli.job_views import status_table
from service.scheduler.divergence import DIVERGED_EVENT, DIVERGED_FACTOR
from service.scheduler.ingest import write_snapshot
from service.schemas.views import JobPublic
from tests.api.specs import tiny
from tests.api.test_progress import snap


def _job(sf: sessionmaker[Session], spec: dict) -> str:
    with sf() as s:
        create_token(s, tenant="team-a")
        job = store.create_job(s, tenant="team-a", name="lr-too-high", spec=spec, plan={}, total_steps=100)
        for state in ("queued", "starting"):
            store.transition(s, job.id, state, reason="test")
        s.commit()
        return job.id


def _at(step: int, loss: float) -> dict:
    out = snap("running", step, step_time=0.1)
    out["progress"]["loss"] = loss
    return out


def _events(sf: sessionmaker[Session], job_id: str) -> list:
    with sf() as s:
        return [e for e in store.list_events(s, job_id, limit=1000) if e.type == DIVERGED_EVENT]


def test_a_loss_worse_than_a_uniform_guess_is_reported_once_and_the_job_runs_on(
        db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    job_id = _job(sf, tiny(train={"steps": 10, "global_batch": 4, "lr": 10.0}))
    bound = DIVERGED_FACTOR * math.log(256)
    write_snapshot(sf, job_id, 0, _at(1, 5.6), [])  # ln(256) = 5.55: a fresh model's loss
    write_snapshot(sf, job_id, 0, _at(2, bound * 0.99), [])
    assert _events(sf, job_id) == []
    write_snapshot(sf, job_id, 0, _at(3, 11965.0), [])
    write_snapshot(sf, job_id, 0, _at(4, 20000.0), [])
    (event,) = _events(sf, job_id)
    assert event.payload["step"] == 3 and event.payload["loss"] == 11965.0 and event.payload["lr"] == 10.0
    assert "diverged" in event.payload["message"] and "train.lr (now 10.0)" in event.payload["message"]
    with sf() as s:
        view = JobPublic.from_row(store.get_job(s, job_id))
    assert view.state == "running" and view.progress.diverged_at == 3
    console = Console(width=200, record=True)
    console.print(status_table(view.model_dump(mode="json"), wide=False))
    assert "20000.0000 (diverged at step 3: see lattice events)" in console.export_text()


def test_a_healthy_loss_or_a_spec_without_a_model_raises_nothing(
        db_session_factory: sessionmaker[Session]) -> None:
    sf = db_session_factory
    healthy, unnamed = _job(sf, tiny()), _job(sf, {})
    for step, loss in enumerate((5.6, 4.0, 2.5, 1.2), start=1):
        write_snapshot(sf, healthy, 0, _at(step, loss), [])
        write_snapshot(sf, unnamed, 0, _at(step, 1e6), [])
    assert _events(sf, healthy) == [] and _events(sf, unnamed) == []
    with sf() as s:
        assert JobPublic.from_row(store.get_job(s, healthy)).progress.diverged_at is None
