"""A thin scheduler process for the failover test: `python -m tests.control_plane.scheduler_proc
DB_URL STARTS_FILE READY_FILE` runs the real Scheduler loop with its leader elector, on the fake
Ray side of tests.control_plane.fakes (every job's controller is alive, as a detached controller
outlives the scheduler that started it), until it is killed. Starts are appended to STARTS_FILE;
READY_FILE appears once the scheduler runs (leading or waiting hot). Lease and renewal come from
LATTICE_LEADER_LEASE_S / LATTICE_LEADER_RENEW_S."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from service.scheduler.leader import LeaderElector
from service.scheduler.loop import Scheduler
from service.settings import Settings
from service.store.db import make_engine, make_session_factory
from tests.control_plane.fakes import FakeWorkers


def main(db_url: str, starts_file: str, ready_file: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s: %(message)s")
    settings = Settings(database_url=db_url, gpu_type="cpu-virtual", scheduler_interval_s=0.2)
    FakeWorkers(Path(starts_file), every_job_has_a_controller=True).install()
    engine = make_engine(db_url)
    elector = LeaderElector(engine, lease_s=settings.leader_lease_s, renew_s=settings.leader_renew_s)
    scheduler = Scheduler(settings, elector.session_factory(engine),
                          read_session_factory=make_session_factory(engine, read_only=True), leader=elector)
    elector.on_change = scheduler.wake
    scheduler.start()
    Path(ready_file).write_text("ready\n")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
