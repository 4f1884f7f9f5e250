"""/healthz (the process is up), /readyz (database reachable, schema at head), /metrics (Prometheus)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service import metrics, store
from service.api.problems import problem_responses
from service.errors import ServiceUnavailable
from service.schemas import Health, Readiness
from service.store import migrate
from service.store.models import JobState

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, summary="Readiness", responses=problem_responses(503))
def readyz(request: Request) -> Readiness:
    engine = request.app.state.engine
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            revision = migrate.current_revision(conn)
    except SQLAlchemyError as e:
        log.warning("readiness: database unreachable: %s", e)
        raise ServiceUnavailable(f"database unreachable: {type(e).__name__}") from e
    head = migrate.head_revision()
    if revision != head:
        raise ServiceUnavailable(
            f"database schema at revision {revision}, expected {head}; run the migrations"
        )
    return Readiness(status="ready", database="ok", migration=revision)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus text exposition.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def prometheus_metrics(request: Request) -> Response:
    _refresh_job_gauges(request)
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _refresh_job_gauges(request: Request) -> None:
    try:
        with request.app.state.read_session_factory() as session:
            counts = store.count_jobs_by_state(session)
    except SQLAlchemyError:
        log.warning("metrics: cannot count jobs", exc_info=True)
        return
    for state, n in counts.items():
        metrics.JOBS_BY_STATE.labels(state.value).set(n)
    metrics.QUEUE_DEPTH.set(counts[JobState.PENDING] + counts[JobState.QUEUED])
