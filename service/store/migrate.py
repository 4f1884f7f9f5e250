"""Run the Alembic migrations, guarded against two processes doing it at once.

SQLite: an exclusive file lock next to the database file. PostgreSQL: a session-level
`pg_advisory_lock` held on the connection that runs the migrations. `lattice serve` and
`lattice token create` call `upgrade`; `alembic upgrade head` (alembic.ini at the repository
root) does the same from the command line, reading the URL from the settings.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.engine import Connection

from service.store.db import sqlite_path

log = logging.getLogger(__name__)

# Arbitrary, fixed: identifies "Lattice schema migration" among advisory locks (ASCII "LATTMIGR").
PG_MIGRATION_LOCK_KEY = 0x4C4154544D494752


def migrations_dir() -> Path:
    """The `migrations` directory: next to `service/` in a checkout, else the installed package."""
    beside = Path(__file__).resolve().parents[2] / "migrations"
    if (beside / "env.py").is_file():
        return beside
    return Path(str(files("migrations")))


def alembic_config(*, url: str | None = None, connection: Connection | None = None) -> Config:
    """An Alembic config for the `migrations` package.

    `connection` wins over `url`, which wins over the settings (see migrations/env.py)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@lru_cache(maxsize=1)
def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def is_at_head(engine: Engine) -> bool:
    with engine.connect() as conn:
        return current_revision(conn) == head_revision()


@contextmanager
def migration_lock(engine: Engine) -> Iterator[Connection]:
    """Exclusive right to migrate (and bootstrap) this database.

    Yields a connection outside any transaction."""
    if engine.dialect.name == "sqlite":
        path = sqlite_path(str(engine.url))
        if path is None:  # in-memory: nobody else can see it
            with engine.connect() as conn:
                yield conn
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".migrate.lock"), "a+") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                with engine.connect() as conn:
                    yield conn
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        return
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_lock({PG_MIGRATION_LOCK_KEY})")
            conn.commit()
            try:
                yield conn
            finally:
                conn.rollback()
                conn.exec_driver_sql(f"SELECT pg_advisory_unlock({PG_MIGRATION_LOCK_KEY})")
                conn.commit()
        return
    raise ValueError(f"unsupported database backend {engine.dialect.name!r}; use sqlite or postgresql")


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Upgrade the database to `revision` under the migration lock; returns the revision it is at."""
    with migration_lock(engine) as conn:
        return upgrade_locked(conn, revision)


def upgrade_locked(conn: Connection, revision: str = "head") -> str | None:
    """Upgrade on a connection that holds the migration lock (see `migration_lock`)."""
    before = current_revision(conn)
    conn.rollback()
    command.upgrade(alembic_config(connection=conn), revision)
    conn.commit()
    after = current_revision(conn)
    conn.rollback()
    if before != after:
        log.info("database migrated from %s to %s", before, after)
    return after


def downgrade(engine: Engine, revision: str) -> str | None:
    with migration_lock(engine) as conn:
        command.downgrade(alembic_config(connection=conn), revision)
        conn.commit()
        after = current_revision(conn)
        conn.rollback()
    return after
