"""/healthz (the process is up), /readyz (database reachable, schema at head), /metrics (Prometheus)."""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from service import metrics, store
from service.api.deps import SettingsDep, principal_for_token
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.api.worker_metrics import WorkerAggregateCollector
from service.errors import Forbidden, ServiceUnavailable, Unauthorized
from service.schemas import Health, Readiness
from service.store import migrate
from service.store.models import JobState

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"], route_class=ModelResponseRoute)


@router.get("/healthz", response_model=Health, summary="Liveness")
async def healthz() -> Health:
    """On the event loop itself: never waits for the database or a worker thread."""
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


_scrape_bearer = HTTPBearer(
    auto_error=False, description="With LATTICE_METRICS_AUTH: an admin token or the metrics scrape token."
)


def _scrape_token(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError as e:
        log.warning("metrics: cannot read the scrape token file %s: %s", path, e.strerror or e)
        return None
    return text.splitlines()[0].strip() if text else None


def require_metrics_access(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_scrape_bearer)],
) -> None:
    """With `metrics_auth` on, /metrics (every tenant's jobs) needs the scrape token or an admin token."""
    if not settings.metrics_auth or not settings.auth_enabled:
        return
    if credentials is None or not credentials.credentials:
        raise Unauthorized("/metrics needs a bearer token: send the header 'Authorization: Bearer <token>'")
    given = credentials.credentials
    scrape = _scrape_token(settings.metrics_token_file)
    if scrape is not None and hmac.compare_digest(given.encode(), scrape.encode()):
        return
    if not principal_for_token(request, given).is_admin:
        raise Forbidden("/metrics needs an admin token or the scrape token of LATTICE_METRICS_TOKEN_FILE")


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    dependencies=[Depends(require_metrics_access)],
    responses={
        200: {
            "description": "Prometheus text exposition.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **problem_responses(401, 403),
    },
)
def prometheus_metrics(request: Request) -> Response:
    _refresh_job_gauges(request)
    metrics_dir = getattr(request.app.state, "metrics_dir", None)  # set in each of several API workers
    source = WorkerAggregateCollector(metrics_dir, metrics.REGISTRY) if metrics_dir else metrics.REGISTRY
    return Response(generate_latest(source), media_type=CONTENT_TYPE_LATEST)


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
