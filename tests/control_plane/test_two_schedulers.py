"""Two schedulers on one database and one (fake) Ray cluster: only the elected one acts (a job is
started once, its events are not doubled); when the leader stops renewing, the other takes over,
re-attaches to the running job's controller without starting it again; a deposed leader that wakes
up after its lease ran out writes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service import metrics, store
from service.api.operations import plan_job
from service.scheduler.leader import LeaderElector
from service.scheduler.loop import Scheduler
from service.schemas import JobSpec
from service.settings import Settings
from service.store.db import make_session_factory
from service.store.models import JobState
from tests.api.specs import tiny
from tests.control_plane.fakes import FakeWorkers

LEASE_S, RENEW_S = 2.0, 0.5  # generous: the tests run on a loaded machine


def submit(sf: sessionmaker[Session], settings: Settings, name: str) -> str:
    spec = JobSpec.model_validate(tiny(name=name))
    with store.session_scope(sf) as s:
        store.ensure_tenant(s, "t")
        return store.create_job(s, tenant="t", name=name, spec=spec.canonical(),
                                plan=plan_job(spec, settings)).id


def scheduler(settings: Settings, engine: Engine, holder: str) -> tuple[Scheduler, LeaderElector]:
    elector = LeaderElector(engine, holder=holder, lease_s=LEASE_S, renew_s=RENEW_S)
    sched = Scheduler(settings, elector.session_factory(engine),
                      read_session_factory=make_session_factory(engine, read_only=True), leader=elector)
    return sched, elector


def events(sf: sessionmaker[Session], job_id: str) -> list[tuple[str, dict]]:
    with sf() as s:
        return [(e.type, dict(e.payload)) for e in store.list_events(s, job_id, limit=None)]


def state_moves(evs: list[tuple[str, dict]]) -> list[str]:
    return [p["to"] for t, p in evs if t == "state"]


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", database_url=db_url, gpu_type="cpu-virtual")


def test_only_the_leader_acts_and_the_other_takes_over_without_starting_the_job_again(
    settings: Settings, db_engine: Engine, db_session_factory: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = FakeWorkers()
    workers.install(monkeypatch)
    job_id = submit(db_session_factory, settings, "once")
    a, ea = scheduler(settings, db_engine, "host-a:1")
    b, eb = scheduler(settings, db_engine, "host-b:2")
    for _ in range(3):  # both loops run; only a acts
        ea.step()
        assert a.step() is True
        assert metrics.SCHEDULER_LEADER._value.get() == 1  # noqa: SLF001 - the gauge's value
        eb.step()
        assert b.step() is False
    assert workers.starts == [job_id] and a.attached_jobs() == [job_id] and b.attached_jobs() == []
    before = events(db_session_factory, job_id)
    assert state_moves(before) == ["queued", "starting"]

    # a stops renewing (SIGKILL): b takes over, re-attaches to the controller, does not start it again
    deadline = time.monotonic() + 10
    while not b.step():
        assert time.monotonic() < deadline, "b did not take over within 10 s"
        eb.step()
        time.sleep(RENEW_S / 2)
    assert eb.term == 2 and b.attached_jobs() == [job_id] and workers.starts == [job_id]
    after = events(db_session_factory, job_id)
    assert after[: len(before)] == before
    assert [t for t, _ in after[len(before):]] == ["reattached"]

    # a wakes up: its lease ran out, so its loop does not act, and its fence refuses what it tries
    late = submit(db_session_factory, settings, "late")
    assert a.step() is False and a.attached_jobs() == []
    ea.fence.term, ea._renewed_at = 1, time.monotonic()  # noqa: SLF001 - as if a had not noticed yet
    assert a.step() is False  # its admission write hit the fence: it stepped down
    assert ea.term is None and a.attached_jobs() == []
    with db_session_factory() as s:
        assert store.get_job(s, late).state == JobState.PENDING.value
    assert b.step() is True
    with db_session_factory() as s:
        assert store.get_job(s, late).state != JobState.PENDING.value
    assert workers.starts == [job_id]  # one job holds the GPUs' reservation in flight: late waits
    final = events(db_session_factory, job_id)
    assert state_moves(final) == ["queued", "starting"] and [t for t, _ in final].count("reattached") == 1

