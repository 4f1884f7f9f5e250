"""SIGKILL of the leader scheduler process: two real scheduler processes (the Scheduler loop and its
leader elector, on the fake Ray side of tests.control_plane.fakes) on one database; the leader starts
a queued job; after the kill the other takes the lease within 10 s (a functional timeout), re-attaches
to the job's controller and does not start it again; no stored event is lost or doubled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.settings import Settings
from service.store.leases import read_lease
from tests.control_plane.test_two_schedulers import events, state_moves, submit
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


class Proc:
    def __init__(self, db_url: str, tmp: Path, name: str) -> None:
        self.starts, self.ready, self.log = tmp / "starts", tmp / f"{name}.ready", tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
        env |= {"LATTICE_LEADER_LEASE_S": "4", "LATTICE_LEADER_RENEW_S": "1", "LATTICE_HOME": str(tmp / name)}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.control_plane.scheduler_proc", db_url, str(self.starts),
                 str(self.ready)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return f"\n--- {self.log.name} ---\n" + "\n".join(self.log.read_text().splitlines()[-30:])


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for p in made:
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait(30)


def test_the_standby_takes_over_from_a_sigkilled_leader_and_reattaches(
    db_url: str, db_engine: Engine, db_session_factory: sessionmaker[Session], tmp_path: Path,
    procs: list[Proc],
) -> None:
    settings = Settings(home=tmp_path / "home", database_url=db_url, gpu_type="cpu-virtual")
    job_id = submit(db_session_factory, settings, "failover")

    def holder() -> str | None:
        with Session(db_engine) as s:
            lease = read_lease(s)
        return lease.holder if lease is not None else None

    def logs() -> str:
        return "".join(p.tail() for p in procs)

    first = Proc(db_url, tmp_path, "first")
    procs.append(first)
    wait_for(lambda: first.ready.exists(), 120, f"the first scheduler{logs()}")
    assert holder() is not None and holder().endswith(f":{first.proc.pid}")  # type: ignore[union-attr]
    second = Proc(db_url, tmp_path, "second")
    procs.append(second)
    wait_for(lambda: second.ready.exists(), 120, f"the second scheduler{logs()}")
    wait_for(lambda: first.starts.exists() and first.starts.read_text(), 60, f"the job's start{logs()}")
    time.sleep(1.5)  # both loops run a few ticks: the second waits hot
    assert holder().endswith(f":{first.proc.pid}")  # type: ignore[union-attr]
    before = events(db_session_factory, job_id)
    assert state_moves(before) == ["queued", "starting"], before

    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(30)
    wait_for(lambda: (holder() or "").endswith(f":{second.proc.pid}"), 10, f"the takeover{logs()}")
    wait_for(lambda: any(t == "reattached" for t, _ in events(db_session_factory, job_id)), 30,
             f"the new leader to re-attach{logs()}")
    time.sleep(1.0)  # a few more ticks of the new leader
    after = events(db_session_factory, job_id)
    assert after[: len(before)] == before
    assert [t for t, _ in after[len(before):]] == ["reattached"], after
    assert first.starts.read_text().split() == [job_id]  # started once, by the first leader only
    with db_session_factory() as s:
        assert store.get_job(s, job_id).state == "starting"
