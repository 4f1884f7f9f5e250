"""Tokens: only a SHA-256 hash reaches the database; revoked and unknown tokens do not authenticate."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session, sessionmaker

from service import auth
from service.errors import Unauthorized
from service.store.models import ApiToken, Role, utcnow


def test_only_the_hash_is_stored(db_session_factory: sessionmaker[Session]) -> None:
    with db_session_factory() as s:
        token = auth.create_token(s, tenant="team-a", description="ci")
        s.commit()
    assert token.startswith("lat_") and len(token) > 40
    with db_session_factory() as s:
        row = s.scalar(select(ApiToken))
        assert row is not None and row.token_hash == hashlib.sha256(token.encode()).hexdigest()
        dump = [str(v) for r in s.execute(text("SELECT * FROM api_tokens")) for v in r]
        assert token not in " ".join(dump)
        assert auth.authenticate(s, token) == auth.Principal(tenant="team-a", role=Role.USER, token_id=row.id)
        with pytest.raises(Unauthorized):
            auth.authenticate(s, token + "x")
        s.execute(update(ApiToken).values(revoked_at=utcnow()))
        with pytest.raises(Unauthorized):
            auth.authenticate(s, token)


def test_bootstrap_token_once_and_private(db_session_factory: sessionmaker[Session], tmp_path: Path) -> None:
    path = tmp_path / "home" / "token"
    with db_session_factory() as s:
        token = auth.ensure_bootstrap_token(s, path)
        s.commit()
        assert token is not None
        assert path.read_text().strip() == token
        assert path.stat().st_mode & 0o777 == 0o600
        assert auth.authenticate(s, token).is_admin
        assert auth.ensure_bootstrap_token(s, path) is None  # an admin exists: nothing new
