"""/v1/tenants: admins list tenants and set each tenant's job-priority cap, GPU quota, fair-share
weight and whether it may borrow idle GPUs (the scheduler's admission obeys them:
service/scheduler/fairshare.py).

A non-admin job's `priority` may not exceed its tenant's `max_priority`, or the service default
(`LATTICE_MAX_USER_PRIORITY`) when the tenant has none; admins may set any priority.
A PUT sets the fields it names; the others keep their values (a new tenant starts with no quota,
weight 1, no borrowing and the default priority cap).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import AdminPrincipal, ReadSessionDep, SessionDep, SettingsDep
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.store import tenants as tenant_store
from service.store.models import Tenant

router = APIRouter(prefix="/v1/tenants", tags=["tenants"], route_class=ModelResponseRoute)

TenantName = Annotated[
    str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The tenant.")
]


class TenantUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_priority: int | None = Field(
        default=None, ge=-1000, le=1000,
        description="Highest priority this tenant's users may give a job; null = default.",
    )
    gpu_quota: int | None = Field(
        default=None, ge=0, le=10_000_000,
        description="GPUs this tenant's running jobs may hold together; null = no cap.",
    )
    weight: float = Field(
        default=1.0, gt=0, le=1000,
        description="Fair-share weight: shares of the cluster are proportional to it.",
    )
    borrowing: bool = Field(
        default=False,
        description="May run jobs on idle GPUs beyond its quota (marked borrowing, reclaimable).",
    )


class TenantPublic(BaseModel):
    name: str
    max_priority: int | None = Field(description="The tenant's priority cap; null = the service default.")
    default_max_priority: int = Field(description="The service default cap (LATTICE_MAX_USER_PRIORITY).")
    gpu_quota: int | None = Field(description="GPUs its running jobs may hold; null = no cap.")
    weight: float = Field(description="Fair-share weight.")
    borrowing: bool = Field(description="Whether it may borrow idle GPUs beyond its quota.")


class TenantList(BaseModel):
    items: list[TenantPublic]


def _public(row: Tenant, default: int) -> TenantPublic:
    return TenantPublic(name=row.name, max_priority=row.max_priority, default_max_priority=default,
                        gpu_quota=row.gpu_quota, weight=float(row.weight if row.weight is not None else 1.0),
                        borrowing=bool(row.borrowing))


@router.get("", response_model=TenantList, summary="List tenants (admin)",
            responses=problem_responses(401, 403))
def list_tenants(session: ReadSessionDep, principal: AdminPrincipal, settings: SettingsDep) -> TenantList:
    default = settings.max_user_priority
    return TenantList(items=[_public(t, default) for t in tenant_store.list_tenants(session)])


@router.put("/{tenant}", response_model=TenantPublic,
            summary="Set a tenant's priority cap, GPU quota, weight and borrowing (admin)",
            description="Creates the tenant if it does not exist yet; fields left out keep their values.",
            responses=problem_responses(401, 403, 422))
def update_tenant(
    tenant: TenantName, body: TenantUpdate, session: SessionDep, principal: AdminPrincipal,
    settings: SettingsDep,
) -> TenantPublic:
    row = tenant_store.update_tenant(session, tenant, **body.model_dump(include=body.model_fields_set))
    public = _public(row, settings.max_user_priority)
    session.commit()
    return public
