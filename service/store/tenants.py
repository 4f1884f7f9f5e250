"""Tenants, API tokens (hashes only) and idempotency keys."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.store.models import ApiToken, IdempotencyKey, Role, Tenant, utcnow


def ensure_tenant(session: Session, name: str) -> None:
    """Create the tenant if it does not exist (safe against a concurrent creator)."""
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    session.execute(insert(Tenant).values(name=name, created_at=utcnow()).on_conflict_do_nothing())


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


# What an admin sets on a tenant (PUT /v1/tenants/{tenant}).
TENANT_SETTINGS = frozenset({"max_priority", "gpu_quota", "weight", "borrowing"})


def update_tenant(session: Session, name: str, **fields: object) -> Tenant:
    """Create the tenant if needed and set the given fields (the others keep their values)."""
    unknown = set(fields) - TENANT_SETTINGS
    if unknown:
        raise ValueError(f"update_tenant cannot set {sorted(unknown)}; allowed: {sorted(TENANT_SETTINGS)}")
    ensure_tenant(session, name)
    row = session.get(Tenant, name)
    assert row is not None  # just ensured
    session.refresh(row)  # the identity map may hold a row from before a concurrent update
    for key, value in fields.items():
        setattr(row, key, value)
    session.flush()
    return row


def add_token(
    session: Session,
    *,
    tenant: str,
    role: Role,
    token_hash: str,
    description: str | None = None,
    expires_at: dt.datetime | None = None,
) -> ApiToken:
    ensure_tenant(session, tenant)
    row = ApiToken(
        tenant=tenant, role=role.value, token_hash=token_hash, description=description, expires_at=expires_at
    )
    session.add(row)
    session.flush()
    return row


def find_token(session: Session, token_hash: str) -> ApiToken | None:
    """The token with this hash, revoked and expired ones included (the caller says which it was)."""
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash))


def _live(now: dt.datetime) -> list[ColumnElement[bool]]:
    return [ApiToken.revoked_at.is_(None), or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now)]


def count_tokens(session: Session, *, role: Role | None = None, now: dt.datetime | None = None) -> int:
    """Live tokens: neither revoked nor expired."""
    query = select(func.count()).select_from(ApiToken).where(*_live(now or utcnow()))
    if role is not None:
        query = query.where(ApiToken.role == role.value)
    return session.scalar(query) or 0


def list_tokens(session: Session, *, tenant: str | None = None, role: Role | None = None) -> list[ApiToken]:
    """Tokens in creation order, revoked and expired ones included (their times say so)."""
    query = select(ApiToken).order_by(ApiToken.id)
    if tenant is not None:
        query = query.where(ApiToken.tenant == tenant)
    if role is not None:
        query = query.where(ApiToken.role == role.value)
    return list(session.scalars(query))


def get_token(session: Session, token_id: int) -> ApiToken | None:
    return session.get(ApiToken, token_id)


def other_live_admins(session: Session, token_id: int, now: dt.datetime) -> int:
    """Live admin tokens besides `token_id`. Every live admin row is locked, in id order (PostgreSQL;
    SQLite writers are serial anyway), so two revocations of the last two admin tokens neither both
    pass the check nor deadlock: the second waits, then sees the first one's revocation."""
    query = (
        select(ApiToken.id)
        .where(ApiToken.role == Role.ADMIN.value, *_live(now))
        .order_by(ApiToken.id)
        .with_for_update()
    )
    return sum(1 for i in session.scalars(query) if i != token_id)


def revoke_token(session: Session, row: ApiToken, now: dt.datetime) -> ApiToken:
    """Mark the token revoked (a revoked token keeps its first revocation time)."""
    if row.revoked_at is None:
        row.revoked_at = now
        session.flush()
    return row


def touch_token(session: Session, token_id: int, now: dt.datetime, interval: dt.timedelta) -> bool:
    """Record a use of the token unless one was recorded within `interval`; True if it wrote.
    The condition is in the UPDATE itself, so concurrent requests write at most once."""
    result = session.execute(
        update(ApiToken)
        .where(
            ApiToken.id == token_id,
            or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at <= now - interval),
        )
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def find_idempotency_key(session: Session, tenant: str, key: str) -> IdempotencyKey | None:
    return session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.tenant == tenant, IdempotencyKey.key == key)
    )


def add_idempotency_key(session: Session, *, tenant: str, key: str, request_hash: str, job_id: str) -> None:
    """Record the key; a concurrent request that got there first makes the flush raise IntegrityError."""
    session.add(IdempotencyKey(tenant=tenant, key=key, request_hash=request_hash, job_id=job_id))
    session.flush()
