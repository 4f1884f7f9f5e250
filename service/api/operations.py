"""What the job routes do, kept out of the routes so they stay thin: plan, submit (idempotent),
look up with tenant visibility, list with cursors, cancel. Each function owns its transaction."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service import store
from service.api.data_root import resolve_data_path
from service.api.deps import SchedulerHook
from service.api.weights import resolve_init_from, resolve_validation_path
from service.auth import Principal
from service.checkpoint_period import shown_with_plan
from service.errors import (
    ConcurrentUpdate,
    Conflict,
    Forbidden,
    IdempotencyConflict,
    InvalidRequest,
    JobNotFound,
    LatticeError,
)
from service.schemas import JobPublic, JobSpec
from service.settings import Settings
from service.store import tenants as tenant_store
from service.store.db import read_phase
from service.store.models import Job, JobState, Tenant
from training.config.layout import Layout

if TYPE_CHECKING:
    from service.planner.efficiency import HardwareProfile

log = logging.getLogger(__name__)

_CANCEL_RETRIES = 5


# ---- planning ------------------------------------------------------------------------------------
def plan_job(spec: JobSpec, settings: Settings, profile: HardwareProfile | None = None) -> dict[str, Any]:
    """The Plan for a spec: searched (`parallelism: auto`), filled in (a partial layout) or
    evaluated (a layout that runs as given), all by service.planner.plan_layout.

    The cluster is the one the settings describe (the embedded shape) unless the spec asks for
    a GPU count; the scheduler re-plans if the live cluster differs.
    """
    from service.planner import (
        ClusterSpec,
        PlannerError,
        TrainSpec,
        default_precision,
        layout_gpus,
        plan_layout,
    )

    try:
        model = spec.model_spec()
    except ValueError as e:
        raise InvalidRequest(str(e), errors=[{"field": "model.preset", "message": str(e)}]) from e
    given = spec.layout_given()
    if spec.resources.gpus is not None:
        num_gpus = spec.resources.gpus
    elif given is not None:
        num_gpus = layout_gpus(model, given, spec.train.global_batch, settings.embedded_num_gpus)
    else:
        num_gpus = settings.embedded_num_gpus
    field = "parallelism" if given is not None else "resources"
    gpus_from = "resources.gpus" if spec.resources.gpus is not None else "the cluster's GPUs"
    try:
        cluster = ClusterSpec(
            gpu_type=spec.resources.gpu_type or settings.gpu_type,
            num_gpus=num_gpus,
            gpus_per_node=settings.embedded_gpus_per_node,
            nodes_per_rack=settings.embedded_nodes_per_rack,
            profile=profile,  # the newest measured profile of this GPU type (service.store.profiles)
        )
        train = TrainSpec(
            global_batch=spec.train.global_batch, seq_len=model.seq_len,
            precision=spec.train.precision or default_precision(cluster.gpu_type),
            shadow_optimizer=spec.fault_tolerance.shadow_optimizer,
        )
        result = plan_layout(model, train, cluster, given, gpus_from=gpus_from, allow_unfit=spec.allow_unfit)
    except (PlannerError, ValueError) as e:
        message = str(e).replace("layout.", "parallelism.") if given is not None else str(e)
        raise InvalidRequest(
            f"no feasible plan: {field}: {message}", errors=[{"field": field, "message": message}]
        ) from e
    return result.to_dict()


# ---- submit ---------------------------------------------------------------------------------------
class Submission(NamedTuple):
    job: Job
    created: bool  # False: a replay of an earlier submit with the same Idempotency-Key and body
    # A new job's JobPublic JSON, serialised before the commit to prove the row can be served; the
    # commit changes nothing in it (no refresh: expire_on_commit=False), so the response sends it.
    body: str | None = None


def request_hash(spec: JobSpec) -> str:
    canonical = json.dumps(spec.canonical(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def submit_job(
    session: Session, principal: Principal, spec: JobSpec, settings: Settings, idempotency_key: str | None
) -> Submission:
    """Create the job (state pending, plan attached).

    With an idempotency key, a retry with the same body returns the first job (created=False)
    and a different body is a 409. Concurrent first attempts race on the unique (tenant, key)
    constraint: the loser rolls back and returns the winner's job.
    """
    from service.store.profiles import profile_for

    digest = request_hash(spec)
    read_phase(session)  # one read transaction for the lookups: no SQLite write lock for them
    if idempotency_key is not None:
        replay = _replay(session, principal, idempotency_key, digest)
        if replay is not None:
            session.commit()
            return Submission(replay, created=False)
    check_submit_policy(session, principal, spec, settings)
    profile = profile_for(session, spec.resources.gpu_type or settings.gpu_type)
    session.commit()  # end the read before planning: no transaction (nor lock) held while it plans
    plan = shown_with_plan(spec, plan_job(spec, settings, profile), settings)
    check_plan_fits(spec, plan)
    check_elastic_bounds(spec, plan)
    stored = spec.canonical()
    if spec.data.kind == "tokens" and spec.data.path:  # the ranks open the resolved path, never the user's
        dtype = getattr(spec.data, "dtype", "uint16")
        stored["data"]["path"] = resolve_data_path(
            settings, spec.data.path, seq_len=spec.model_spec().seq_len, dtype=dtype
        )
    validation = getattr(spec.data, "validation", None)
    if validation is not None and validation.path is not None:
        stored["data"]["validation"]["path"] = resolve_validation_path(
            settings, validation.path, spec.model_spec().seq_len, spec.data.dtype
        )
    init_from = getattr(spec.model, "init_from", None)
    if init_from is not None:  # inside the data root, and the tensors match the spec (torch-free)
        stored["model"]["init_from"]["path"] = resolve_init_from(
            settings, init_from.path, init_from.format, spec.model_spec()
        )
    try:
        if principal.token_id is None:  # a token's tenant exists (foreign key; tenants are never deleted)
            tenant_store.ensure_tenant(session, principal.tenant)
        job = store.create_job(
            session,
            tenant=principal.tenant,
            name=spec.name,
            spec=stored,
            plan=plan,
            priority=spec.priority,
            total_steps=spec.train.steps,
        )
        if idempotency_key is not None:
            tenant_store.add_idempotency_key(
                session, tenant=principal.tenant, key=idempotency_key, request_hash=digest, job_id=job.id
            )
        body = _check_servable(session, job)
        session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key is None:
            raise
        replay = _replay(session, principal, idempotency_key, digest)
        session.commit()
        if replay is None:
            raise
        return Submission(replay, created=False)
    return Submission(job, created=True, body=body)


def check_submit_policy(session: Session, principal: Principal, spec: JobSpec, settings: Settings) -> None:
    """What only an admin may ask for: spec faults (and only with injection on), `allow_unfit`,
    `preemption.preemptible: false`, and a
    priority above the tenant's cap (tenants.max_priority, else LATTICE_MAX_USER_PRIORITY)."""
    if spec.faults:
        if not principal.is_admin:
            raise _field_error(Forbidden, "faults", "injecting faults needs an admin token")
        if not settings.fault_injection:
            raise _field_error(
                InvalidRequest, "faults",
                "fault injection is off on this server; it acts on faults only when started with "
                "LATTICE_FAULT_INJECTION=true (tests and demos only)",
            )
    if principal.is_admin:
        return
    if spec.allow_unfit:
        raise _field_error(Forbidden, "allow_unfit", "only an admin may run a job whose plan does not fit")
    if not spec.preemption.preemptible:
        raise _field_error(Forbidden, "preemption.preemptible",
                           "only an admin may make a job non-preemptible")
    read_phase(session)  # a read; the caller ends it (submit_job: after its other lookups)
    tenant = session.get(Tenant, principal.tenant)
    cap = tenant.max_priority if tenant is not None and tenant.max_priority is not None else None
    cap = settings.max_user_priority if cap is None else cap
    if spec.priority > cap:
        raise _field_error(
            InvalidRequest, "priority",
            f"must be at most {cap} for tenant {principal.tenant!r} (its priority cap), got {spec.priority}; "
            "an admin may set a higher priority or raise the cap",
        )


def check_plan_fits(spec: JobSpec, plan: dict[str, Any]) -> None:
    """A plan that does not fit in GPU memory is refused unless the (admin's) spec says allow_unfit."""
    if plan.get("fits", True) or spec.allow_unfit:
        return
    reasons = [r for r in plan.get("reasons", []) if "not fit" in r] or list(plan.get("reasons", []))[:1]
    reason = reasons[0] if reasons else "the plan needs more memory per GPU than the GPU has"
    field = "parallelism" if spec.layout_given() is not None else "resources"
    raise _field_error(
        InvalidRequest, field,
        f"the plan does not fit: {reason}; change the layout or resources "
        "(an admin may set allow_unfit: true)",
    )


def check_elastic_bounds(spec: JobSpec, plan: dict[str, Any]) -> None:
    """An elastic job cannot need more GPUs than its plan: `fault_tolerance.min_gpus` <= its world size."""
    ft = spec.fault_tolerance
    world = Layout.from_dict(plan["layout"]).world_size if plan.get("layout") else None
    if ft.min_gpus is not None and world is not None and ft.min_gpus > world:
        raise _field_error(InvalidRequest, "fault_tolerance.min_gpus",
                           f"{ft.min_gpus} is more than the {world} GPUs of the job's plan")


def _field_error(kind: type[LatticeError], field: str, message: str) -> LatticeError:
    return kind(f"{field}: {message}", errors=[{"field": field, "message": message}])


def _check_servable(session: Session, job: Job) -> str:
    """Serialise the job as GET will, before the commit: a row that cannot be served is never stored.
    Returns the JSON (by alias, as FastAPI sends a response model)."""
    try:
        return JobPublic.from_row(job).model_dump_json(by_alias=True)
    except (ValueError, TypeError, RecursionError) as e:
        session.rollback()
        raise InvalidRequest(
            "the job cannot be stored: its spec or plan would not serialise back",
            errors=[{"field": "body", "message": "the job would not serialise back"}],
        ) from e


def _replay(session: Session, principal: Principal, key: str, digest: str) -> Job | None:
    row = tenant_store.find_idempotency_key(session, principal.tenant, key)
    if row is None:
        return None
    if row.request_hash != digest:
        raise IdempotencyConflict(
            f"Idempotency-Key {key!r} was already used with a different request body (job {row.job_id}); "
            "use a new key for a different job"
        )
    return store.get_job(session, row.job_id)


# ---- read -----------------------------------------------------------------------------------------
def visible_job(session: Session, principal: Principal, job_id: str) -> Job:
    """The job if this caller may see it; another tenant's job is indistinguishable from none."""
    job = session.get(Job, job_id)
    if job is None or not principal.can_see(job.tenant):
        raise JobNotFound(job_id)
    return job


def encode_cursor(job_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": job_id}).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        after = json.loads(raw)["after"]
        if not isinstance(after, str) or not after.isalnum() or len(after) > 26:
            raise ValueError(after)
        return after
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise InvalidRequest(
            "cursor is not a cursor this server issued; pass `next_cursor` from the previous page unchanged",
            errors=[{"field": "cursor", "message": "invalid cursor", "location": "query"}],
        ) from e


def list_visible_jobs(
    session: Session,
    principal: Principal,
    *,
    states: list[str] | None,
    tenant: str | None,
    limit: int,
    cursor: str | None,
) -> tuple[list[Job], str | None]:
    if tenant is not None and not principal.is_admin and tenant != principal.tenant:
        return [], None  # a user asking for another tenant sees nothing, as if it did not exist
    scope = tenant if principal.is_admin else principal.tenant
    after = decode_cursor(cursor) if cursor else None
    jobs = store.list_jobs(session, tenant=scope, states=states, limit=limit + 1, after_id=after)
    next_cursor = encode_cursor(jobs[limit - 1].id) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


# ---- cancel ---------------------------------------------------------------------------------------
def cancel_job(session: Session, principal: Principal, job_id: str, scheduler: SchedulerHook | None) -> Job:
    """Cancel a job that has not finished; cancelling a cancelled job returns it unchanged.

    A job with ranks (starting, running, recovering) is marked cancelled first, then the
    scheduler is told to stop it; the ranks never outlive a state that says they should stop.
    """
    for _ in range(_CANCEL_RETRIES):
        job = visible_job(session, principal, job_id)
        session.refresh(job)
        state = JobState(job.state)
        if state == JobState.CANCELLED:
            session.commit()
            return job
        if state.terminal:
            raise Conflict(f"job {job_id!r} already {state.value}; only unfinished jobs can be cancelled")
        try:
            job = store.transition(
                session,
                job_id,
                JobState.CANCELLED,
                expected_version=job.version,
                reason=f"cancelled by {principal.role.value} of tenant {principal.tenant}",
            )
            session.commit()
        except ConcurrentUpdate:
            session.rollback()
            continue
        if scheduler is not None:
            if state in store.ACTIVE_STATES:
                scheduler.cancel(job_id)
            scheduler.wake()
        return job
    raise Conflict(f"job {job_id!r} kept changing while cancelling; retry")


# ---- resume ---------------------------------------------------------------------------------------
def resume_job(session: Session, principal: Principal, job_id: str, scheduler: SchedulerHook | None) -> Job:
    """Continue a failed or cancelled job as a new attempt from its last verified checkpoint (from
    step 0, said in the event and `reason`, when it has none): the job goes back to `queued`.

    A succeeded job, or one still queued or running, is a 409 naming its state; so is a job whose
    old ranks are still stopping (the scheduler still holds its controller): retry shortly.
    """
    job = visible_job(session, principal, job_id)
    session.refresh(job)
    state = JobState(job.state)
    if state not in store.RESUME_TRANSITIONS:
        what = "it already succeeded" if state == JobState.SUCCEEDED else "it has not finished"
        raise Conflict(
            f"job {job_id!r} is {state.value}: {what}; only a failed or cancelled job can be resumed"
        )
    attached = getattr(scheduler, "attached_jobs", None)
    if attached is not None and job_id in attached():
        raise Conflict(
            f"job {job_id!r} is {state.value} but its ranks are still stopping; retry in a few seconds"
        )
    ckpt = store.latest_checkpoint(session, job_id, verified_only=True)
    try:
        job = store.resume_job(
            session, job_id, expected_version=job.version, checkpoint_step=ckpt.step if ckpt else None,
            by=f"{principal.role.value} of tenant {principal.tenant}",
        )
        session.commit()
    except ConcurrentUpdate as e:
        session.rollback()
        raise Conflict(f"job {job_id!r} changed while resuming; retry") from e
    if scheduler is not None:
        scheduler.wake()
    return job
