"""Admission plans between transactions: the planner's CPU time never holds SQLite's write lock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.api.operations import plan_job
from service.scheduler import admission
from service.schemas import JobSpec
from service.settings import Settings
from workers.topology import Topology


def test_planning_holds_no_write_lock_and_a_job_changed_meanwhile_is_left_alone(
    db_url: str, db_session_factory: sessionmaker[Session], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("the write lock is SQLite's")
    settings = Settings(home=tmp_path, gpu_type="cpu-virtual")
    spec = JobSpec.model_validate({"name": "h100", "model": {"preset": "demo"},
                                   "train": {"steps": 2, "global_batch": 8},
                                   "resources": {"gpus": 8, "gpu_type": "H100"}})
    with store.session_scope(db_session_factory) as s:
        store.ensure_tenant(s, "t")
        made = [store.create_job(s, tenant="t", name=n, spec=spec.canonical(), plan=plan_job(spec, settings))
                for n in ("a", "b")]
        kept, raced = made[0].id, made[1].id
    real_plan = admission.plan_layout
    writes: list[str] = []

    def plan_while_another_writer_writes(*args, **kwargs):  # type: ignore[no-untyped-def]
        # Another process takes the write lock at once (timeout 0): it fails if admission holds it.
        conn = sqlite3.connect(db_url.removeprefix("sqlite:///"), timeout=0)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE jobs SET priority = priority + 1 WHERE id = ?", (raced,))
            conn.execute("UPDATE jobs SET version = version + 1 WHERE id = ?", (raced,))
            conn.commit()
            writes.append("ok")
        finally:
            conn.close()
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(admission, "plan_layout", plan_while_another_writer_writes)
    admission.admit_pending(db_session_factory, db_session_factory, settings, Topology.uniform(2, 2, 4))
    assert writes == ["ok", "ok"]  # the other writer got the lock during both plans
    with db_session_factory() as s:
        assert store.get_job(s, kept).state == "queued"
        assert store.get_job(s, kept).plan["cluster"]["gpu_type"] == "cpu-virtual"
        # its version moved while it was being planned: not admitted now, the next tick will
        assert store.get_job(s, raced).state == "pending"
