"""Migrations agree with the models and run both ways, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from service.store import migrate
from service.store.db import make_engine
from service.store.models import Base

TABLES = {"tenants", "api_tokens", "jobs", "job_events", "checkpoints", "nodes", "idempotency_keys"}


def test_upgrade_downgrade_round_trip_and_no_autogenerate_diff(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert migrate.upgrade(engine) == migrate.head_revision() is not None
        assert TABLES <= set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
        assert migrate.is_at_head(engine)
        assert migrate.downgrade(engine, "base") is None
        assert not TABLES & set(inspect(engine).get_table_names())
        assert not migrate.is_at_head(engine)
        migrate.upgrade(engine)
        assert TABLES <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_concurrent_upgrades_are_serialised(db_url: str) -> None:
    """Four processes' worth of `lattice serve` starting at once: the lock lets one migrate."""
    engine = make_engine(db_url)
    barrier = threading.Barrier(4)
    results: list[object] = []

    def run() -> None:
        barrier.wait()
        try:
            results.append(migrate.upgrade(engine))
        except Exception as e:  # noqa: BLE001 - the assertion below reports it
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.dispose()
    assert results == [migrate.head_revision()] * 4


def test_alembic_command_line_reads_the_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "alembic",
            "-c",
            str(root / "alembic.ini"),
            "-x",
            f"url={url}",
            "upgrade",
            "head",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    engine = make_engine(url)
    assert migrate.is_at_head(engine)
    engine.dispose()
