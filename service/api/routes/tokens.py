"""/v1/tokens: admins create API tokens (the CLI's `lattice token create` does the same on the database);
everyone lists and revokes the tokens they may see.

Visibility: an admin sees every token; a user sees the user tokens of their own tenant (never an admin
token, not even their tenant's: a user must not be able to lock the admins out). A token the caller
may not see answers 404, the same as one that does not exist, so ids are no oracle. No response
carries a token's secret or its hash.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, status
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service.api.deps import AdminPrincipal, CurrentPrincipal, ReadSessionDep, SessionDep
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.auth import Principal, create_token_row
from service.errors import Conflict, NotFound
from service.schemas import TokenCreate, TokenCreated
from service.store import tenants as tenant_store
from service.store.models import ApiToken, Role, utcnow

router = APIRouter(prefix="/v1/tokens", tags=["auth"], route_class=ModelResponseRoute)

TokenId = Annotated[int, Path(ge=1, le=2**31 - 1, description="The token's id (from `GET /v1/tokens`).")]
TenantFilter = Annotated[
    str | None,
    Query(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
          description="Only this tenant's tokens (admins; a user always sees only their own tenant)."),
]


class TokenPublic(BaseModel):
    id: int
    tenant: str
    role: Literal["admin", "user"]
    description: str | None
    status: Literal["active", "expired", "revoked"]
    created_at: dt.datetime
    expires_at: dt.datetime | None = Field(description="When it stops working; null = never.")
    last_used_at: dt.datetime | None = Field(
        description="Its latest recorded use (recorded at most once a minute); null = never used."
    )
    revoked_at: dt.datetime | None


class TokenList(BaseModel):
    items: list[TokenPublic]


def token_public(row: ApiToken, now: dt.datetime) -> TokenPublic:
    if row.revoked_at is not None:
        state = "revoked"
    elif row.expires_at is not None and row.expires_at <= now:
        state = "expired"
    else:
        state = "active"
    return TokenPublic(
        id=row.id, tenant=row.tenant, role=row.role, description=row.description,  # type: ignore[arg-type]
        status=state, created_at=row.created_at, expires_at=row.expires_at,  # type: ignore[arg-type]
        last_used_at=row.last_used_at, revoked_at=row.revoked_at,
    )


def _visible(principal: Principal, row: ApiToken | None) -> bool:
    if row is None:
        return False
    return principal.is_admin or (row.tenant == principal.tenant and row.role == Role.USER.value)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    summary="Create an API token (admin)",
    responses=problem_responses(401, 403, 422),
)
def create(body: TokenCreate, session: SessionDep, principal: AdminPrincipal) -> TokenCreated:
    token, row = create_token_row(
        session, tenant=body.tenant, admin=body.admin, description=body.description, ttl_s=body.ttl_s
    )
    created = TokenCreated(
        token=token, tenant=body.tenant, role="admin" if body.admin else "user", id=row.id,
        expires_at=row.expires_at,
    )
    session.commit()
    return created


@router.get("", response_model=TokenList, summary="List API tokens (never their secrets)",
            responses=problem_responses(401, 422))
def list_tokens(
    session: ReadSessionDep, principal: CurrentPrincipal, tenant: TenantFilter = None
) -> TokenList:
    now = utcnow()
    if principal.is_admin:
        rows = tenant_store.list_tokens(session, tenant=tenant)
    elif tenant is not None and tenant != principal.tenant:
        rows = []
    else:
        rows = tenant_store.list_tokens(session, tenant=principal.tenant, role=Role.USER)
    return TokenList(items=[token_public(r, now) for r in rows])


def _revoke(session: Session, principal: Principal, token_id: int) -> TokenPublic:
    now = utcnow()
    row = tenant_store.get_token(session, token_id)
    if row is None or not _visible(principal, row):
        raise NotFound(f"token {token_id} not found")
    live_admin = row.role == Role.ADMIN.value and row.revoked_at is None and (
        row.expires_at is None or row.expires_at > now
    )
    if live_admin and tenant_store.other_live_admins(session, row.id, now) == 0:
        raise Conflict(
            f"token {token_id} is the last live admin token; create another admin token before revoking it"
        )
    tenant_store.revoke_token(session, row, now)
    public = token_public(row, now)
    session.commit()
    return public


@router.delete(
    "/{token_id}",
    response_model=TokenPublic,
    summary="Revoke an API token",
    description="The token answers 401 from now on. Revoking a revoked token changes nothing. "
    "A user may revoke their own tenant's user tokens; an admin any token but the last live admin token.",
    responses=problem_responses(401, 404, 409, 422),
)
def revoke(token_id: TokenId, session: SessionDep, principal: CurrentPrincipal) -> TokenPublic:
    return _revoke(session, principal, token_id)
