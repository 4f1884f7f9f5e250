"""Database fixtures shared by every test package.

`db_url` is parametrized over SQLite (a fresh file per test) and PostgreSQL (a fresh schema per
test, selected with `search_path` in the URL, so a server subprocess can use the same URL).
PostgreSQL comes from LATTICE_TEST_POSTGRES_URL, default the local server. When it is
unreachable the PostgreSQL cases fail under CI (CI=true) and skip otherwise.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

# The scheduler's background calibration of new node types (service/scheduler/autocalibrate.py) is
# off in tests, and in the servers they start (subprocesses inherit it); the tests of it turn it on.
os.environ.setdefault("LATTICE_AUTO_CALIBRATE", "false")


def postgres_url() -> str:
    return os.environ.get("LATTICE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


@lru_cache(maxsize=1)
def _postgres_error() -> str | None:
    try:
        engine = create_engine(postgres_url(), connect_args={"connect_timeout": 3})
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as e:  # noqa: BLE001 - any failure means "not reachable"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def require_postgres() -> None:
    error = _postgres_error()
    if error is None:
        return
    message = f"PostgreSQL at {postgres_url()} is unreachable ({error})"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message + "; CI needs it (.ci/run starts it)")
    pytest.skip(message)


def _with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture
def postgres_schema_url() -> Iterator[str]:
    """A URL whose connections see only a fresh, empty schema (dropped afterwards)."""
    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(postgres_url())
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.commit()
    try:
        yield _with_search_path(postgres_url(), schema)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.commit()
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: a fresh SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'lattice.db'}"
    else:
        yield request.getfixturevalue("postgres_schema_url")


@pytest.fixture
def db_engine(db_url: str) -> Iterator[Engine]:
    """An engine on a database with the current schema (tables from the models, stamped at head)."""
    from alembic import command

    from service.store.db import make_engine
    from service.store.migrate import alembic_config
    from service.store.models import Base

    engine = make_engine(db_url)
    Base.metadata.create_all(engine)
    with engine.connect() as conn:
        command.stamp(alembic_config(connection=conn), "head")
        conn.commit()
    yield engine
    engine.dispose()


@pytest.fixture
def db_session_factory(db_engine: Engine) -> sessionmaker[Session]:
    from service.store.db import make_session_factory

    return make_session_factory(db_engine)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip on a machine without CUDA (torch is imported only if there are any)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
