"""Bearer tokens, roles and tenants.

A token is `lat_` + 32 random bytes (URL-safe base64). Only its SHA-256 is stored; the token
itself is shown once, when it is created. A user token sees its own tenant's jobs only; an
admin token sees every tenant and may create tokens.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session

from service.errors import Unauthorized
from service.store import tenants as tenant_store
from service.store.models import Role

log = logging.getLogger(__name__)

TOKEN_PREFIX = "lat_"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant and a role."""

    tenant: str
    role: Role
    token_id: int | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == Role.ADMIN

    def can_see(self, tenant: str) -> bool:
        return self.is_admin or tenant == self.tenant


# The caller when authentication is disabled (development only).
ANONYMOUS_ADMIN = Principal(tenant=DEFAULT_TENANT, role=Role.ADMIN)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def generate_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def create_token(
    session: Session, *, tenant: str, admin: bool = False, description: str | None = None
) -> str:
    """Create a token (and its tenant if new); returns the plaintext token, which is not stored."""
    token = generate_token()
    tenant_store.add_token(
        session,
        tenant=tenant,
        role=Role.ADMIN if admin else Role.USER,
        token_hash=hash_token(token),
        description=description,
    )
    return token


def authenticate(session: Session, token: str) -> Principal:
    row = tenant_store.find_token(session, hash_token(token))
    if row is None:
        raise Unauthorized("invalid or revoked bearer token")
    return Principal(tenant=row.tenant, role=Role(row.role), token_id=row.id)


def ensure_bootstrap_token(session: Session, token_file: Path) -> str | None:
    """On a database without any admin token, create one for the default tenant, write it to
    `token_file` (mode 0600) and return it; otherwise return None. Call under the migration lock."""
    if tenant_store.count_tokens(session, role=Role.ADMIN) > 0:
        return None
    token = create_token(session, tenant=DEFAULT_TENANT, admin=True, description="bootstrap admin")
    write_token_file(token_file, token)
    return token


def write_token_file(path: Path, token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Create with 0600 from the start: the token is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
