"""The one-off migration (deploy/migrate.sh): waits for the database, then `alembic upgrade head`."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from tests.deploy.prom import free_port
from tests.deploy.tools import ROOT, in_ci, run

WAIT = ROOT / "deploy" / "wait_for_db.py"
MIGRATE = ROOT / "deploy" / "migrate.sh"
ADMIN_URL = os.environ.get("LATTICE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def test_wait_gives_up_on_an_unreachable_database() -> None:
    url = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"
    result = run(
        [sys.executable, str(WAIT), "--timeout", "1.5", "--interval", "0.3"],
        env=_env(LATTICE_DATABASE_URL=url),
    )
    assert result.returncode == 1, result.stderr
    assert "attempt 2" in result.stderr  # it retried before giving up
    assert "not ready after" in result.stderr


def test_wait_and_migrate_need_a_url() -> None:
    assert run([sys.executable, str(WAIT)], env=_env()).returncode == 2
    result = run([str(MIGRATE)], env=_env())
    assert result.returncode == 2 and "LATTICE_DATABASE_URL" in result.stderr
    result = run([sys.executable, str(WAIT)], env=_env(LATTICE_DATABASE_URL="not a url"))
    assert result.returncode == 2 and "not a valid" in result.stderr


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A fresh PostgreSQL database on the test server, dropped afterwards."""
    admin = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"lattice_deploy_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as e:
        admin.dispose()
        if in_ci():
            raise
        pytest.skip(f"PostgreSQL is not reachable at {ADMIN_URL}: {e.__class__.__name__}")
    try:
        yield make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.postgres
def test_migrate_brings_an_empty_postgres_to_head(empty_database: str) -> None:
    result = run(
        [str(MIGRATE)],
        env=_env(LATTICE_DATABASE_URL=empty_database, LATTICE_DB_WAIT_SECONDS="10"),
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "database ready after 1 attempt" in result.stderr

    from service.store.migrate import head_revision

    engine = create_engine(empty_database)
    try:
        with engine.connect() as conn:
            assert (
                conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head_revision()
            )
            assert len(inspect(conn).get_table_names()) > 1
    finally:
        engine.dispose()
    # Running it again is a no-op, as a re-deploy does.
    again = run([str(MIGRATE)], env=_env(LATTICE_DATABASE_URL=empty_database), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
