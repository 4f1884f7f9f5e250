"""The FastAPI application. `create_app(settings)` needs only a database: no Ray, no scheduler.

A scheduler plugs in through `app.state.scheduler` (see service.api.deps.SchedulerHook): the
routes call `wake()` after a submit or cancel and `cancel(job_id)` for a job with live ranks.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy import Engine

from service.api.data_root import check_data_root
from service.api.deps import SchedulerHook, get_principal
from service.api.limits import BodyLimitMiddleware
from service.api.middleware import MetricsMiddleware
from service.api.overload import LoadShedMiddleware, RateLimitMiddleware
from service.api.planning import PlanPool
from service.api.problems import add_problem_schemas, install_problem_handlers, problem_responses
from service.api.routes import cluster, exports, faults, health, jobs, logs, plans, tenants, tokens
from service.api.shed_protocol import SHED_STATE
from service.settings import Settings, get_settings
from service.store.db import make_engine, make_session_factory

API_DESCRIPTION = """Lattice runs distributed training jobs for transformer language models on a Ray cluster:
it plans the parallel layout, places the ranks on the network hierarchy, checkpoints, and recovers from
faults.

Authenticate with `Authorization: Bearer <token>`. Errors are `application/problem+json` documents whose
`errors` list names each offending field."""


def create_app(
    settings: Settings | None = None, *, engine: Engine | None = None, scheduler: SchedulerHook | None = None
) -> FastAPI:
    settings = settings or get_settings()
    engine = engine or make_engine(settings.db_url, pool_size=settings.db_pool_size)
    app = FastAPI(title="Lattice", version="0.1.0", description=API_DESCRIPTION)
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.read_session_factory = make_session_factory(engine, read_only=True)
    app.state.scheduler = scheduler
    app.state.plan_pool = PlanPool.from_settings(settings)  # plan searches run in worker processes
    check_data_root(settings)  # refuse to start with a data root that exposes the service's state
    install_problem_handlers(app)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RateLimitMiddleware, rate=settings.rate_limit_per_s, burst=settings.rate_limit_burst)
    app.add_middleware(LoadShedMiddleware, max_inflight=settings.max_inflight_requests,
                       concurrency=settings.api_threads, max_queue_wait_s=settings.max_queue_wait_ms / 1e3,
                       threads=settings.api_thread_tokens,
                       publish=lambda shed: setattr(app.state, SHED_STATE, shed))  # for ShedHttpProtocol
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)  # outermost: before auth
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(logs.router)
    app.include_router(exports.router)
    # The planner's router carries no auth of its own: any valid token may plan.
    app.include_router(plans.router, dependencies=[Depends(get_principal)], responses=problem_responses(401))
    app.include_router(tokens.router)
    app.include_router(tenants.router)
    app.include_router(faults.router)
    app.include_router(cluster.router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            app.openapi_schema = add_problem_schemas(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def create_probe_app(settings: Settings, *, engine: Engine) -> FastAPI:
    """What a `--role scheduler` process serves on LATTICE_SCHEDULER_PORT: /healthz, /readyz and
    /metrics (its scheduler's metrics: the jobs' series and `lattice_scheduler_leader`), no API."""
    app = FastAPI(title="Lattice scheduler", version="0.1.0")
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.read_session_factory = make_session_factory(engine, read_only=True)
    app.state.scheduler = None
    install_problem_handlers(app)
    app.include_router(health.router)
    return app
