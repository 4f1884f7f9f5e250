"""The scheduler's leader lease on the database (SQLite and PostgreSQL): one holder at a time, a
takeover once the holder stops renewing, and the fence that refuses a deposed holder's writes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.errors import NotLeader
from service.scheduler.leader import LeaderElector
from service.store.leases import read_lease, take_lease
from service.store.models import JobState

LEASE_S, RENEW_S = 1.5, 0.3  # generous: the tests run on a loaded machine


def elector(engine: Engine, holder: str, **kw: object) -> LeaderElector:
    return LeaderElector(engine, holder=holder, lease_s=LEASE_S, renew_s=RENEW_S, **kw)  # type: ignore[arg-type]


def until(step: LeaderElector, timeout_s: float = 10.0) -> int:
    """Step `step` until it leads; the term (a functional timeout, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        term = step.step()
        if term is not None:
            return term
        time.sleep(RENEW_S / 2)
    raise AssertionError(f"{step.holder} did not take the lease within {timeout_s} s")


def make_job(sf: sessionmaker[Session]) -> str:
    with store.session_scope(sf) as s:
        store.ensure_tenant(s, "t")
        job = store.create_job(s, tenant="t", name="j", spec={}, plan=None)
        store.transition(s, job.id, JobState.QUEUED)
        return job.id


def test_one_holder_at_a_time_and_a_takeover_after_the_lease_runs_out(db_engine: Engine) -> None:
    a, b = elector(db_engine, "host-a:1"), elector(db_engine, "host-b:2")
    assert a.step() == 1
    assert b.step() is None  # a renews: b waits hot
    for _ in range(4):
        time.sleep(RENEW_S)
        assert a.step() == 1 and b.step() is None
    # a stops renewing (a SIGKILL): b takes over in the next term once it has seen no renewal for a lease
    assert until(b) == 2
    with Session(db_engine) as s:
        lease = read_lease(s)
    assert lease is not None and (lease.holder, lease.term) == ("host-b:2", 2)
    # a comes back: its renewal finds the row taken, it steps down and does not take it back
    assert a.step() is None and a.term is None
    assert a.step() is None and b.step() == 2


def test_a_deposed_leaders_late_write_is_refused_by_the_fence(
    db_engine: Engine, db_session_factory: sessionmaker[Session]
) -> None:
    job_id = make_job(db_session_factory)
    a, b = elector(db_engine, "host-a:1"), elector(db_engine, "host-b:2")
    a_sf = a.session_factory(db_engine)
    with pytest.raises(NotLeader):  # not elected yet: no write at all
        with store.session_scope(a_sf) as s:
            store.transition(s, job_id, JobState.STARTING)
    assert a.step() == 1
    with store.session_scope(a_sf) as s:  # the leader's write goes through
        store.append_event(s, job_id, "note", {"by": "a"})
    b.step()
    assert until(b) == 2  # a paused past its lease (it has not noticed)
    with pytest.raises(NotLeader, match="deposed"):
        with store.session_scope(a_sf) as s:
            store.transition(s, job_id, JobState.STARTING, reason="a's late start")
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        types = [e.type for e in store.list_events(s, job_id)]
    assert job.state == JobState.QUEUED.value and types.count("note") == 1
    b_sf = b.session_factory(db_engine)
    with store.session_scope(b_sf) as s:  # the new leader writes
        store.transition(s, job_id, JobState.STARTING, reason="b's start")


def test_a_released_lease_is_taken_at_once_in_a_higher_term(db_engine: Engine) -> None:
    a, b = elector(db_engine, "host-a:1"), elector(db_engine, "host-b:2")
    a.start()
    assert a.acting_term() == 1 and b.step() is None
    a.stop(release=True)
    assert b.step() == 2  # no wait for the lease to run out
    with Session(db_engine) as s:
        lease = read_lease(s)
    assert lease is not None and lease.current_holder() == "host-b:2"


def test_a_dead_holder_on_this_host_is_replaced_at_once_when_asked(db_engine: Engine) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        a = elector(db_engine, f"{socket.gethostname()}:{holder.pid}")
        assert a.step() == 1
        reaper = elector(db_engine, "other:3", reap_dead_local_holder=True)
        assert reaper.step() is None  # the holder's process lives: wait for its lease
    finally:
        holder.kill()
        holder.wait()
    patient = elector(db_engine, "other:4")
    assert patient.step() is None  # without the local check it waits for the lease to run out
    assert reaper.step() == 2  # the holder's pid is gone on this host: taken at once


def test_a_take_loses_to_a_renewal_made_after_the_lease_was_read(db_engine: Engine) -> None:
    a = elector(db_engine, "host-a:1")
    assert a.step() == 1
    with Session(db_engine) as s:
        seen = read_lease(s)
    time.sleep(0.01)
    assert a.step() == 1  # a renews after b read the row
    with Session(db_engine) as s:
        assert take_lease(s, "scheduler", "host-b:2", seen=seen, lease_s=LEASE_S) is None
        s.commit()
        lease = read_lease(s)
    assert lease is not None and (lease.holder, lease.term) == ("host-a:1", 1)
