"""/v1/jobs: submit, list, get, cancel, resume, events.

Thin: parse, call service.api.operations, serialise."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Path, Query, Response, status

from service import store
from service.api import operations
from service.api.deps import (
    CurrentPrincipal,
    ReaderPrincipal,
    ReadSessionDep,
    SchedulerDep,
    SessionDep,
    SettingsDep,
    SubmitterPrincipal,
)
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute, json_response, model_response
from service.schemas import (
    DEMO_SPEC,
    EXPLICIT_SPEC,
    EventPage,
    EventPublic,
    JobPage,
    JobPublic,
    JobSpec,
    JobStateName,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=ModelResponseRoute)

JobId = Annotated[
    str, Path(pattern=r"^[0-9A-Za-z]{1,64}$", description="Job id.", examples=["01JABCDEF0123456789ABCDEFG"])
]
IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=255,
        pattern=r"^[\x21-\x7e]+$",
        description="Makes retries safe: the same key and body return the same job; "
        "the same key with a different body is a 409.",
    ),
]
SPEC_EXAMPLES = {
    "auto": {"summary": "Planner chooses the layout", "value": DEMO_SPEC},
    "explicit": {"summary": "Explicit model and layout, with an injected fault", "value": EXPLICIT_SPEC},
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    summary="Submit a job",
    responses={
        200: {
            "description": "Replay of an earlier submit with the same Idempotency-Key and body.",
            "model": JobPublic,
        },
        **problem_responses(401, 403, 409, 413, 422, 503),
    },
)
def submit_job(
    spec: Annotated[JobSpec, Body(openapi_examples=SPEC_EXAMPLES)],
    session: SessionDep,
    principal: SubmitterPrincipal,
    settings: SettingsDep,
    scheduler: SchedulerDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    job, created, body = operations.submit_job(session, principal, spec, settings, idempotency_key)
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
        return model_response(JobPublic.from_row(job), status.HTTP_200_OK, headers)
    if scheduler is not None:
        scheduler.wake()
    assert body is not None  # a new job's JSON, checked before its commit
    return json_response(body, status.HTTP_201_CREATED, headers)


@router.get(
    "", response_model=JobPage, summary="List jobs, newest first", responses=problem_responses(401, 422, 503)
)
def list_jobs(
    session: ReadSessionDep,
    principal: ReaderPrincipal,
    state: Annotated[list[JobStateName] | None, Query(description="Only jobs in these states.")] = None,
    tenant: Annotated[
        str | None,
        Query(
            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
            description="Only this tenant's jobs (admin; users see their own).",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Page size.")] = 50,
    cursor: Annotated[
        str | None, Query(max_length=200, description="`next_cursor` of the previous page.")
    ] = None,
) -> JobPage:
    jobs, next_cursor = operations.list_visible_jobs(
        session, principal, states=list(state) if state else None, tenant=tenant, limit=limit, cursor=cursor
    )
    return JobPage(items=[JobPublic.from_row(j) for j in jobs], next_cursor=next_cursor)


@router.get(
    "/{job_id}",
    response_model=JobPublic,
    summary="Get a job",
    responses=problem_responses(401, 404, 422, 503),
)
def get_job(job_id: JobId, session: ReadSessionDep, principal: ReaderPrincipal) -> JobPublic:
    job = JobPublic.from_row(operations.visible_job(session, principal, job_id))
    session.rollback()  # the read ends on this thread: the session then closes without a hop to another
    return job


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    summary="Cancel a job",
    description="Pending and queued jobs are cancelled at once; a starting or running job is marked "
    "cancelled and its ranks are stopped. Cancelling a cancelled job returns it; a finished job is a 409.",
    responses=problem_responses(401, 404, 409, 422),
)
def cancel_job(
    job_id: JobId, session: SessionDep, principal: CurrentPrincipal, scheduler: SchedulerDep
) -> JobPublic:
    return JobPublic.from_row(operations.cancel_job(session, principal, job_id, scheduler))


@router.post(
    "/{job_id}/resume",
    response_model=JobPublic,
    summary="Resume a failed or cancelled job",
    description="Puts a failed or cancelled job back in the queue as a new attempt (`attempt` + 1, a "
    "`resume_requested` event). Its ranks restore the job's last verified checkpoint, so training "
    "continues from that step (`step` is set to it) and no step is counted twice; a job with no verified "
    "checkpoint starts over from step 0, which the event and `reason` say. A succeeded, queued or "
    "running job is a 409 naming its state, as is a cancelled job whose ranks are still stopping.",
    responses=problem_responses(401, 404, 409, 422),
)
def resume_job(
    job_id: JobId, session: SessionDep, principal: CurrentPrincipal, scheduler: SchedulerDep
) -> JobPublic:
    return JobPublic.from_row(operations.resume_job(session, principal, job_id, scheduler))


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="A job's event log",
    responses=problem_responses(401, 404, 422),
)
def list_events(
    job_id: JobId,
    session: ReadSessionDep,
    principal: ReaderPrincipal,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="Only events with seq > after.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000, description="Page size.")] = 100,
) -> EventPage:
    operations.visible_job(session, principal, job_id)
    events = store.list_events(session, job_id, after_seq=after, limit=limit + 1)
    next_after = events[limit - 1].seq if len(events) > limit else None
    return EventPage(items=[EventPublic.from_row(e) for e in events[:limit]], next_after=next_after)
