"""Database preparation for a starting process: migrations and the bootstrap admin token, under
one lock, so two processes starting at once neither migrate twice nor mint two bootstrap tokens."""

from __future__ import annotations

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from service.auth import ensure_bootstrap_token
from service.settings import Settings
from service.store import migrate
from service.store.db import make_engine


def prepare_database(settings: Settings, *, bootstrap: bool) -> tuple[Engine, str | None]:
    """Migrate (if enabled) and, for `serve`, create the bootstrap admin token - under one lock,
    so two processes starting at once neither migrate twice nor mint two bootstrap tokens."""
    engine = make_engine(settings.db_url, pool_size=settings.db_pool_size)  # sized with the API's threads
    token = None
    with migrate.migration_lock(engine) as conn:
        if settings.migrate_on_start:
            migrate.upgrade_locked(conn)
        if bootstrap and settings.auth_enabled:
            with Session(bind=conn) as session:
                token = ensure_bootstrap_token(session, settings.token_path)
                session.commit()
    return engine, token
