"""Tenants, API tokens (hashes only) and idempotency keys."""

from __future__ import annotations

from sqlalchemy import func, select
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


def add_token(
    session: Session, *, tenant: str, role: Role, token_hash: str, description: str | None = None
) -> ApiToken:
    ensure_tenant(session, tenant)
    row = ApiToken(tenant=tenant, role=role.value, token_hash=token_hash, description=description)
    session.add(row)
    session.flush()
    return row


def find_token(session: Session, token_hash: str) -> ApiToken | None:
    """The live (not revoked) token with this hash."""
    return session.scalar(
        select(ApiToken).where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    )


def count_tokens(session: Session, *, role: Role | None = None) -> int:
    query = select(func.count()).select_from(ApiToken).where(ApiToken.revoked_at.is_(None))
    if role is not None:
        query = query.where(ApiToken.role == role.value)
    return session.scalar(query) or 0


def find_idempotency_key(session: Session, tenant: str, key: str) -> IdempotencyKey | None:
    return session.scalar(
        select(IdempotencyKey).where(IdempotencyKey.tenant == tenant, IdempotencyKey.key == key)
    )


def add_idempotency_key(session: Session, *, tenant: str, key: str, request_hash: str, job_id: str) -> None:
    """Record the key; a concurrent request that got there first makes the flush raise IntegrityError."""
    session.add(IdempotencyKey(tenant=tenant, key=key, request_hash=request_hash, job_id=job_id))
    session.flush()
