"""Admission from the store: a job over its tenant's quota waits, saying why; a tenant allowed to
borrow runs on idle GPUs and its job is marked borrowing. The scheduler's start is replaced by a
recorder (no Ray): this is the decision, not the launch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler import admission, fairshare
from service.scheduler.loop import Scheduler
from service.settings import Settings
from service.store import tenants as tenant_store
from workers.topology import Topology


def _plan(gpus: int) -> dict[str, Any]:
    return {"layout": {"tp": 1, "dp": gpus}, "predicted": {"step_time_s": 1.0}}


def _job(s: Session, tenant: str, gpus: int, *states: str, priority: int = 0) -> str:
    store.ensure_tenant(s, tenant)
    job = store.create_job(s, tenant=tenant, name=f"{tenant}-{gpus}", spec={"train": {"steps": 10}},
                           plan=_plan(gpus), priority=priority)
    for state in ("queued", *states):
        store.transition(s, job.id, state, reason="test")
    return job.id


class Recorder(Scheduler):
    """The real `_schedule`; `_start` only records what would start."""

    def __init__(self, settings: Settings, sf: sessionmaker[Session]) -> None:
        super().__init__(settings, sf)
        self.started: list[tuple[str, bool]] = []

    def _start(self, job_id: str, version: int, layout: Any, intended: Any, *,
               borrowing: bool = False) -> None:
        self.started.append((job_id, borrowing))


def schedule(scheduler: Recorder) -> None:
    """One scheduling pass (the tick's last step) over 4 nodes of 4 GPUs, all free."""
    scheduler._schedule(Topology.uniform(2, 2, 4))  # noqa: SLF001 - the step under test, without Ray


@pytest.fixture
def scheduler(db_session_factory: sessionmaker[Session], tmp_path: Path) -> Recorder:
    return Recorder(Settings(home=tmp_path, gpu_type="cpu-virtual"), db_session_factory)


def test_a_job_over_quota_waits_with_the_reason_while_another_tenant_starts(
    db_session_factory: sessionmaker[Session], scheduler: Recorder
) -> None:
    sf = db_session_factory
    with store.session_scope(sf) as s:
        store.ensure_tenant(s, "a")
        tenant_store.update_tenant(s, "a", gpu_quota=8)
        _job(s, "a", 8, "starting", "running")
        over = _job(s, "a", 4, priority=50)
        other = _job(s, "b", 4)
    schedule(scheduler)  # 16 GPUs, the running job's 8 not held by Ray here
    assert scheduler.started == [(other, False)]
    with sf() as s:
        waiting = [e.payload["reason"] for e in store.list_events(s, over, limit=None, types=["waiting"])]
        assert waiting == ["quota: 8 of 8 GPUs in use"]
        assert store.get_job(s, over).reason == "queued: quota: 8 of 8 GPUs in use"
    schedule(scheduler)  # the same reason is not noted twice
    with sf() as s:
        assert len(store.list_events(s, over, limit=None, types=["waiting"])) == 1


def test_a_borrowing_tenant_uses_idle_gpus_and_the_job_is_marked(
    db_session_factory: sessionmaker[Session], scheduler: Recorder
) -> None:
    sf = db_session_factory
    with store.session_scope(sf) as s:
        store.ensure_tenant(s, "a")
        tenant_store.update_tenant(s, "a", gpu_quota=4, borrowing=True, weight=2.0)
        _job(s, "a", 4, "starting", "running")
        lent = _job(s, "a", 4)
    with sf() as s:
        decisions = admission.queue_decisions(s, free_gpus=12, now=0.0)
        policies = admission.tenant_policies(s)
    assert policies["a"] == fairshare.TenantPolicy("a", weight=2.0, gpu_quota=4, borrowing=True)
    kinds = [(q.job_id, q.decision.kind if q.decision else None) for q in decisions]
    assert kinds == [(lent, fairshare.BORROWING)]
    schedule(scheduler)
    assert scheduler.started == [(lent, True)]


def test_running_jobs_eta_and_borrowing_come_from_their_progress(
    db_session_factory: sessionmaker[Session],
) -> None:
    sf = db_session_factory
    with store.session_scope(sf) as s:
        running = _job(s, "a", 8, "starting", "running")
        store.update_progress(s, running, progress={"eta_s": 30.0, "borrowing": True})
        head = _job(s, "b", 16)
        short = _job(s, "c", 8)  # 10 steps x 1 s predicted: ends at 110, before the head can start (130)
    with sf() as s:
        got = {q.job_id: q.decision for q in admission.queue_decisions(s, free_gpus=8, now=100.0)}
    assert got[head] is not None and got[head].kind == fairshare.HEAD
    assert got[short] is not None and got[short].start and got[short].kind == fairshare.BACKFILL
