"""/v1/jobs/{id}/exports: export a job's checkpoint to Hugging Face or torch files (asynchronous;
service.api.exports runs it as a subprocess). Another tenant's job is a 404."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, status

from service.api import exports, operations
from service.api.deps import CurrentPrincipal, ReadSessionDep, SettingsDep
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.api.routes.jobs import JobId
from service.schemas.exports import ExportCreate, ExportPublic

router = APIRouter(prefix="/v1/jobs", tags=["exports"], route_class=ModelResponseRoute)

ExportId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="Export id.")]


@router.post(
    "/{job_id}/exports",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ExportPublic,
    summary="Export a checkpoint of the job (runs in the background; poll its status)",
    responses=problem_responses(401, 404, 422),
)
def create_export(
    job_id: JobId, request: Annotated[ExportCreate, Body()], session: ReadSessionDep,
    principal: CurrentPrincipal, settings: SettingsDep,
) -> ExportPublic:
    job = operations.visible_job(session, principal, job_id)
    return exports.start_export(settings, job, request)


@router.get(
    "/{job_id}/exports/{export_id}",
    response_model=ExportPublic,
    summary="The status of an export",
    responses=problem_responses(401, 404, 422),
)
def get_export(
    job_id: JobId, export_id: ExportId, session: ReadSessionDep, principal: CurrentPrincipal,
    settings: SettingsDep,
) -> ExportPublic:
    job = operations.visible_job(session, principal, job_id)
    return exports.get_export(settings, job, export_id)
