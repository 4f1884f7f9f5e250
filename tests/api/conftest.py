"""An app on a fresh database (SQLite and PostgreSQL), with an admin and two tenants' user tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.api.app import create_app
from service.auth import create_token
from service.settings import Settings


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", database_url=db_url)


@pytest.fixture
def app(settings: Settings, db_engine: Engine) -> FastAPI:
    return create_app(settings, engine=db_engine)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def tokens(db_session_factory: sessionmaker[Session]) -> dict[str, str]:
    with db_session_factory() as s:
        made = {
            "admin": create_token(s, tenant="ops", admin=True),
            "a": create_token(s, tenant="team-a"),
            "b": create_token(s, tenant="team-b"),
        }
        s.commit()
    return made


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
