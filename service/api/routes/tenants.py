"""/v1/tenants: admins list tenants and set each tenant's job-priority cap.

A non-admin job's `priority` may not exceed its tenant's `max_priority`, or the service default
(`LATTICE_MAX_USER_PRIORITY`) when the tenant has none; admins may set any priority.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import AdminPrincipal, ReadSessionDep, SessionDep, SettingsDep
from service.api.problems import problem_responses
from service.store import tenants as tenant_store
from service.store.models import Tenant

router = APIRouter(prefix="/v1/tenants", tags=["tenants"])

TenantName = Annotated[
    str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The tenant.")
]


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_priority: int | None = Field(
        ge=-1000, le=1000, description="Highest priority this tenant's users may give a job; null = default."
    )


class TenantPublic(BaseModel):
    name: str
    max_priority: int | None = Field(description="The tenant's priority cap; null = the service default.")
    default_max_priority: int = Field(description="The service default cap (LATTICE_MAX_USER_PRIORITY).")


class TenantList(BaseModel):
    items: list[TenantPublic]


def _public(row: Tenant, default: int) -> TenantPublic:
    return TenantPublic(name=row.name, max_priority=row.max_priority, default_max_priority=default)


@router.get("", response_model=TenantList, summary="List tenants (admin)",
            responses=problem_responses(401, 403))
def list_tenants(session: ReadSessionDep, principal: AdminPrincipal, settings: SettingsDep) -> TenantList:
    default = settings.max_user_priority
    return TenantList(items=[_public(t, default) for t in tenant_store.list_tenants(session)])


@router.put("/{tenant}", response_model=TenantPublic, summary="Set a tenant's priority cap (admin)",
            description="Creates the tenant if it does not exist yet.",
            responses=problem_responses(401, 403, 422))
def update_tenant(
    tenant: TenantName, body: TenantUpdate, session: SessionDep, principal: AdminPrincipal,
    settings: SettingsDep,
) -> TenantPublic:
    tenant_store.ensure_tenant(session, tenant)
    row = session.get(Tenant, tenant)
    assert row is not None  # just ensured
    row.max_priority = body.max_priority
    public = _public(row, settings.max_user_priority)
    session.commit()
    return public
