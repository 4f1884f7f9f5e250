"""Bearer tokens, roles and tenants.

A token is `lat_` + 32 random bytes (URL-safe base64). Only its SHA-256 is stored; the token
itself is shown once, when it is created. A user token sees its own tenant's jobs only; an
admin token sees every tenant and may create tokens. A token may expire (`expires_at`) and be
revoked (`revoked_at`); either way it answers 401. Its last use is recorded at most once a
minute (`TOUCH_INTERVAL`), so authenticating a read does not take the write lock each time.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.errors import Unauthorized
from service.statefiles import write_private
from service.store import tenants as tenant_store
from service.store.models import ApiToken, Role, utcnow

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


# A use within this long of the recorded one is not written again.
TOUCH_INTERVAL = dt.timedelta(minutes=1)
# --ttl 30d, 12h, 90m, 3600s, 2w; the API takes seconds (ttl_s).
_TTL = re.compile(r"^\s*(\d+)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_ttl(text: str) -> int:
    """'30d' -> seconds; ValueError with what is allowed."""
    match = _TTL.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not a duration: use a whole number with a unit s, m, h, d or w (e.g. 30d)"
        )
    return int(match.group(1)) * _UNIT_S[match.group(2)]


def create_token(
    session: Session,
    *,
    tenant: str,
    admin: bool = False,
    description: str | None = None,
    ttl_s: int | None = None,
) -> str:
    """Create a token (and its tenant if new); returns the plaintext token, which is not stored."""
    return create_token_row(session, tenant=tenant, admin=admin, description=description, ttl_s=ttl_s)[0]


def create_token_row(
    session: Session,
    *,
    tenant: str,
    admin: bool = False,
    description: str | None = None,
    ttl_s: int | None = None,
) -> tuple[str, ApiToken]:
    """Like `create_token`, also returning the stored row (its id and expiry)."""
    token = generate_token()
    row = tenant_store.add_token(
        session,
        tenant=tenant,
        role=Role.ADMIN if admin else Role.USER,
        token_hash=hash_token(token),
        description=description,
        expires_at=utcnow() + dt.timedelta(seconds=ttl_s) if ttl_s is not None else None,
    )
    return token, row


def check_live(row: ApiToken | None, now: dt.datetime) -> ApiToken:
    """The row if it is a live token; 401 for an unknown, revoked or expired one."""
    if row is None:
        raise Unauthorized("invalid bearer token")
    if row.revoked_at is not None:
        raise Unauthorized("bearer token revoked; ask an admin for a new one")
    if row.expires_at is not None and row.expires_at <= now:
        raise Unauthorized(f"bearer token expired at {row.expires_at.isoformat(timespec='seconds')}")
    return row


def authenticate(session: Session, token: str, *, now: dt.datetime | None = None) -> Principal:
    row = check_live(tenant_store.find_token(session, hash_token(token)), now or utcnow())
    return Principal(tenant=row.tenant, role=Role(row.role), token_id=row.id)


def authenticate_request(
    read_factory: sessionmaker[Session], write_factory: sessionmaker[Session], token: str
) -> Principal:
    """Authenticate in a short read transaction; record the use in a write transaction only when
    the recorded one is older than `TOUCH_INTERVAL` (a failed record never fails the request)."""
    now = utcnow()
    with read_factory() as session:
        principal, stale = _look_up(session, token, now)
    if stale:
        _record_use(write_factory, principal, now)
    return principal


def authenticate_in(read_session: Session, write_factory: sessionmaker[Session], token: str) -> Principal:
    """Authenticate in the caller's read session and leave its transaction open for the caller's own
    reads (one transaction for the token and the route). It is ended first when the token is refused
    (on this thread) or its use must be recorded (no read held across that write: once a minute)."""
    now = utcnow()
    try:
        principal, stale = _look_up(read_session, token, now)
    except Unauthorized:
        read_session.rollback()
        raise
    if stale:
        read_session.rollback()
        _record_use(write_factory, principal, now)
    return principal


def _look_up(session: Session, token: str, now: dt.datetime) -> tuple[Principal, bool]:
    """The token's principal, and whether its recorded use is older than `TOUCH_INTERVAL`."""
    row = check_live(tenant_store.find_token(session, hash_token(token)), now)
    stale = row.last_used_at is None or row.last_used_at <= now - TOUCH_INTERVAL
    return Principal(tenant=row.tenant, role=Role(row.role), token_id=row.id), stale


def _record_use(write_factory: sessionmaker[Session], principal: Principal, now: dt.datetime) -> None:
    assert principal.token_id is not None
    try:
        with write_factory() as session:
            tenant_store.touch_token(session, principal.token_id, now, TOUCH_INTERVAL)
            session.commit()
    except SQLAlchemyError as e:
        log.warning("cannot record the use of token %s: %s", principal.token_id, type(e).__name__)


def ensure_bootstrap_token(session: Session, token_file: Path) -> str | None:
    """On a database without any admin token, create one for the default tenant, write it to
    `token_file` (mode 0600) and return it; otherwise return None. Call under the migration lock."""
    if tenant_store.count_tokens(session, role=Role.ADMIN) > 0:
        return None
    token = create_token(session, tenant=DEFAULT_TENANT, admin=True, description="bootstrap admin")
    write_token_file(token_file, token)
    return token


def write_token_file(path: Path, token: str) -> None:
    # 0600 from the start: the token is never readable by others, not even briefly.
    write_private(path, token + "\n")
