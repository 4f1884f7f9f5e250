"""Engines and sessions for SQLite (embedded) and PostgreSQL (production).

SQLite runs in WAL mode (readers never block the writer) with a busy timeout. A session from
`make_session_factory(engine)` starts its transactions with `BEGIN IMMEDIATE`: it takes the
write lock up front, so a read-then-write transaction can never fail half way with "database
is locked" when another writer committed in between (the classic deferred-transaction upgrade
failure). Sessions from `make_session_factory(engine, read_only=True)` use a plain deferred
`BEGIN` and never take the write lock, so readers do not queue behind writers. Keep write
transactions short and inside one function call: never hold one across an await or a hop
between threads (a request whose lock holder waits for a worker thread can starve them all).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
_READ_ONLY = "lattice_read_only"  # execution option: begin a deferred (read) transaction


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL (None for in-memory)."""
    database = make_url(url).database
    if not database or database == ":memory:":
        return None
    return Path(database)


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine configured for Lattice's access pattern on either backend."""
    if is_sqlite(url):
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        if "poolclass" not in kwargs:
            # A connection for every worker thread (FastAPI runs sync routes on 40): none waits for the pool.
            kwargs.setdefault("pool_size", 10)
            kwargs.setdefault("max_overflow", 40)
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)
        _configure_sqlite(engine)
        return engine
    if "poolclass" not in kwargs:  # NullPool (migrations) takes no pool sizing
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 30)
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event below emit BEGIN instead of the driver.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL: a crash loses at most the last commit
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")


def make_session_factory(engine: Engine, *, read_only: bool = False) -> sessionmaker[Session]:
    """Sessions for writing (default) or only reading (never takes SQLite's write lock)."""
    bind = engine.execution_options(**{_READ_ONLY: True}) if read_only else engine
    # expire_on_commit=False: routes serialise rows after committing.
    return sessionmaker(bind, expire_on_commit=False)


def read_phase(session: Session) -> None:
    """Begin the next transaction of a write session as a read: on SQLite a deferred `BEGIN`, so a
    read-only stretch (an idempotency lookup, a quota check) never takes the write lock. Call it
    before the stretch's first statement and commit to end it; the next transaction is a write again."""
    if not session.in_transaction():
        session.connection(execution_options={_READ_ONLY: True})


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One short transaction: commit on success, roll back on error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
