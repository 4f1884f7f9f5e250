"""/v1/tokens: admins create API tokens (the CLI's `lattice token create` does the same on the database)."""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api.deps import AdminPrincipal, SessionDep
from service.api.problems import problem_responses
from service.auth import create_token
from service.schemas import TokenCreate, TokenCreated

router = APIRouter(prefix="/v1/tokens", tags=["auth"])


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    summary="Create an API token (admin)",
    responses=problem_responses(401, 403, 422),
)
def create(body: TokenCreate, session: SessionDep, principal: AdminPrincipal) -> TokenCreated:
    token = create_token(session, tenant=body.tenant, admin=body.admin, description=body.description)
    session.commit()
    return TokenCreated(token=token, tenant=body.tenant, role="admin" if body.admin else "user")
