"""Jobs, their state machine and their event log.

`transition` is the one function that changes a job's state. It checks the move against
`LEGAL_TRANSITIONS` (terminal states have no way out; only `resume_job` takes a failed or
cancelled job back to `queued`, see `RESUME_TRANSITIONS`), compare-and-sets on `version`
(`UPDATE jobs SET state=?, version=version+1 WHERE id=? AND version=?`) and appends a `state`
event in the same transaction. None of these functions commit: the caller owns the
transaction (keep it short; see service.store.db).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.errors import ConcurrentUpdate, Conflict, IllegalTransition, JobNotFound
from service.store.models import TERMINAL_STATES, Job, JobEvent, JobState, utcnow

LEGAL_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED, JobState.RECOVERING}
    ),
    JobState.RUNNING: frozenset(
        {JobState.RECOVERING, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    ),
    JobState.RECOVERING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}
# The one way out of a terminal state: `resume_job` (an explicit resume, POST /v1/jobs/{id}/resume)
# moves a failed or cancelled job back to `queued` for a new attempt. `transition` never does; a
# succeeded job has no way out at all.
RESUME_TRANSITIONS: dict[JobState, JobState] = {
    JobState.FAILED: JobState.QUEUED,
    JobState.CANCELLED: JobState.QUEUED,
}
# The other way back to `queued`: a preempted job (a preemption notice made its controller checkpoint
# and stop, workers.controller.preempt) goes from an active state back to the queue through
# `requeue_preempted`, which `transition` never does (a running job otherwise leaves only through
# recovering): queued from running via preempted.
PREEMPT_TRANSITIONS: frozenset[JobState] = frozenset(
    {JobState.STARTING, JobState.RUNNING, JobState.RECOVERING}
)
PREEMPTED_EVENT = "preempted"
# The event an explicit resume appends (the controller's own `resumed` means "training continued").
RESUME_EVENT = "resume_requested"

# Columns a transition may set together with the state (atomically, in the same UPDATE).
TRANSITION_FIELDS = frozenset({"attempt", "error", "result", "plan"})
# Columns update_progress may set; progress does not bump `version`.
PROGRESS_FIELDS = frozenset(
    {"step", "total_steps", "loss", "tokens_per_s", "mfu", "result", "placement", "controller_seq",
     "reason", "progress"}
)

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_job_id() -> str:
    """A ULID: 48-bit millisecond time + 80 random bits, Crockford base32, sortable by creation time."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def parse_state(value: str | JobState) -> JobState:
    try:
        return JobState(value)
    except ValueError as e:
        allowed = ", ".join(s.value for s in JobState)
        raise ValueError(f"state must be one of {allowed}, got {value!r}") from e


def create_job(
    session: Session,
    *,
    tenant: str,
    name: str,
    spec: dict[str, Any],
    plan: dict[str, Any] | None,
    priority: int = 0,
    total_steps: int = 0,
    job_id: str | None = None,
) -> Job:
    """Insert a job in state `pending` and its `created` event (seq 1, allocated here: no other
    writer can see the row before this transaction commits, so append_event's UPDATE is not needed)."""
    job = Job(
        id=job_id or new_job_id(),
        tenant=tenant,
        name=name,
        spec=spec,
        plan=plan,
        state=JobState.PENDING.value,
        version=0,
        priority=priority,
        attempt=0,
        step=0,
        total_steps=total_steps,
        event_seq=1,
    )
    session.add(job)
    session.flush()  # the job row first: the event's foreign key refers to it
    created = {"state": JobState.PENDING.value, "name": name, "tenant": tenant}
    session.add(JobEvent(job_id=job.id, seq=1, type="created", payload=created, time=utcnow()))
    session.flush()
    return job


def get_job(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


def list_jobs(
    session: Session,
    *,
    tenant: str | None = None,
    states: Collection[str | JobState] | None = None,
    limit: int | None = 50,
    after_id: str | None = None,
    order: Literal["newest", "queue"] = "newest",
) -> list[Job]:
    """Jobs, newest first (pages continue strictly after `after_id`), or in queue order
    (priority high to low, then oldest first) for the scheduler."""
    query = select(Job)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    if states:
        query = query.where(Job.state.in_([parse_state(s).value for s in states]))
    if order == "newest":
        if after_id is not None:
            query = query.where(Job.id < after_id)
        query = query.order_by(Job.id.desc())
    else:
        query = query.order_by(Job.priority.desc(), Job.id.asc())
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))


def count_jobs_by_state(session: Session) -> dict[JobState, int]:
    counts = {state: 0 for state in JobState}
    for state, n in session.execute(select(Job.state, func.count()).group_by(Job.state)):
        counts[JobState(state)] = n
    return counts


def transition(
    session: Session,
    job_id: str,
    to_state: str | JobState,
    *,
    expected_version: int | None = None,
    reason: str | None = None,
    event_payload: Mapping[str, Any] | None = None,
    set_fields: Mapping[str, Any] | None = None,
) -> Job:
    """Move a job to `to_state` by compare-and-set on its version; returns the updated job.

    `expected_version` None means "the version read now" (still compare-and-set against a
    concurrent writer). Raises JobNotFound, IllegalTransition (including any move out of a
    terminal state) or ConcurrentUpdate. `set_fields` (attempt, error, result, plan) change in
    the same UPDATE; `reason` goes into the event and, for `failed`, into `error`.
    """
    target = parse_state(to_state)
    values: dict[str, Any] = dict(set_fields or {})
    unknown = set(values) - TRANSITION_FIELDS
    if unknown:
        raise ValueError(f"transition cannot set {sorted(unknown)}; allowed: {sorted(TRANSITION_FIELDS)}")
    job = get_job(session, job_id)
    session.refresh(job)  # the identity map may hold an older version
    current = JobState(job.state)
    if expected_version is not None and job.version != expected_version:
        raise ConcurrentUpdate(job_id, expected_version, job.version)
    allowed = LEGAL_TRANSITIONS[current]
    if target not in allowed:
        raise IllegalTransition(job_id, current.value, target.value, tuple(sorted(s.value for s in allowed)))

    now = utcnow()
    if target == JobState.FAILED and reason and "error" not in values:
        values["error"] = reason
    # `reason` (why the job is in its state, for people) follows every state change.
    values["reason"] = f"{target.value}: {reason}"[:2000] if reason else target.value
    if target == JobState.RUNNING and job.started_at is None:
        values["started_at"] = now
    if target in TERMINAL_STATES:
        values["finished_at"] = now
    version = job.version
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.version == version)
        .values(state=target.value, version=Job.version + 1, updated_at=now, **values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        actual = session.scalar(select(Job.version).where(Job.id == job_id))
        raise ConcurrentUpdate(job_id, version, actual)
    payload: dict[str, Any] = {"from": current.value, "to": target.value, "version": version + 1}
    if reason:
        payload["reason"] = reason
    payload.update(event_payload or {})
    append_event(session, job_id, "state", payload)
    session.refresh(job)
    return job


def resume_job(
    session: Session,
    job_id: str,
    *,
    expected_version: int,
    checkpoint_step: int | None,
    by: str,
) -> Job:
    """Move a failed or cancelled job back to `queued` for a new attempt (compare-and-set on its
    version, as `transition`): attempt + 1, `step` set to the checkpoint it resumes from (0 with
    none: it starts over), error/result/finished_at cleared. Appends the `state` event and a
    `resume_requested` event. Raises Conflict from any other state, ConcurrentUpdate on a race."""
    job = get_job(session, job_id)
    session.refresh(job)
    current = JobState(job.state)
    if job.version != expected_version:
        raise ConcurrentUpdate(job_id, expected_version, job.version)
    if current not in RESUME_TRANSITIONS:
        raise Conflict(f"job {job_id!r} is {current.value}; only a failed or cancelled job can be resumed")
    step = checkpoint_step or 0
    start = f"its last verified checkpoint (step {step})" if checkpoint_step is not None else (
        "step 0 (it has no verified checkpoint)")
    message = f"resumed by {by} from {start}"
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.version == expected_version)
        .values(state=JobState.QUEUED.value, version=Job.version + 1, updated_at=utcnow(),
                attempt=job.attempt + 1, step=step, error=None, result=None, finished_at=None,
                reason=f"queued: {message}"[:2000])
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        actual = session.scalar(select(Job.version).where(Job.id == job_id))
        raise ConcurrentUpdate(job_id, expected_version, actual)
    append_event(session, job_id, "state", {"from": current.value, "to": JobState.QUEUED.value,
                                             "version": expected_version + 1, "reason": message})
    append_event(session, job_id, RESUME_EVENT, {
        "from_state": current.value, "checkpoint_step": checkpoint_step, "step": step,
        "attempt": job.attempt + 1, "by": by, "message": message,
    })
    session.refresh(job)
    return job


def requeue_preempted(session: Session, job_id: str, *, step: int, reason: str) -> Job:
    """Move a preempted job (starting, running or recovering) back to `queued` by compare-and-set:
    `step` set to the checkpoint it resumes from, the `state` event marked `preempted`. Raises
    IllegalTransition from any other state, ConcurrentUpdate on a race."""
    job = get_job(session, job_id)
    session.refresh(job)
    current = JobState(job.state)
    if current not in PREEMPT_TRANSITIONS:
        raise IllegalTransition(job_id, current.value, JobState.QUEUED.value,
                                tuple(sorted(s.value for s in LEGAL_TRANSITIONS[current])))
    version = job.version
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.version == version)
        .values(state=JobState.QUEUED.value, version=Job.version + 1, updated_at=utcnow(), step=step,
                reason=f"queued: {reason}"[:2000])
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        actual = session.scalar(select(Job.version).where(Job.id == job_id))
        raise ConcurrentUpdate(job_id, version, actual)
    append_event(session, job_id, "state", {"from": current.value, "to": JobState.QUEUED.value,
                                             "version": version + 1, "reason": reason, "preempted": True,
                                             "step": step})
    session.refresh(job)
    return job


def append_event(
    session: Session, job_id: str, type: str, payload: Mapping[str, Any] | None = None
) -> JobEvent:
    """Append one event; `seq` is allocated atomically per job (1, 2, 3, ...)."""
    seq = session.scalar(
        update(Job)
        .where(Job.id == job_id)
        .values(event_seq=Job.event_seq + 1)
        .returning(Job.event_seq)
        .execution_options(synchronize_session=False)
    )
    if seq is None:
        raise JobNotFound(job_id)
    event = JobEvent(job_id=job_id, seq=seq, type=type, payload=dict(payload or {}), time=utcnow())
    session.add(event)
    session.flush()
    return event


def list_events(
    session: Session, job_id: str, *, after_seq: int = 0, limit: int | None = 100, types: Collection[str] = ()
) -> list[JobEvent]:
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after_seq)
    if types:
        query = query.where(JobEvent.type.in_(list(types)))
    query = query.order_by(JobEvent.seq)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))


def update_progress(session: Session, job_id: str, **fields: Any) -> None:
    """Record training progress (step, total_steps, loss, tokens_per_s, mfu, result, placement,
    controller_seq, reason, the progress document).

    Does not bump `version`: progress never races a state change's compare-and-set. A job
    in a terminal state keeps its final progress (the update is ignored).
    """
    unknown = set(fields) - PROGRESS_FIELDS
    if unknown:
        raise ValueError(f"update_progress cannot set {sorted(unknown)}; allowed: {sorted(PROGRESS_FIELDS)}")
    if not fields:
        return
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state.not_in([s.value for s in TERMINAL_STATES]))
        .values(updated_at=utcnow(), **fields)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 0 and session.get(Job, job_id) is None:  # type: ignore[attr-defined]
        raise JobNotFound(job_id)


def set_plan(session: Session, job_id: str, plan: dict[str, Any], *, reason: str | None = None) -> None:
    """Replace a job's plan (a replan after losing capacity) and record a `plan` event."""
    result = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(plan=plan, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise JobNotFound(job_id)
    append_event(session, job_id, "plan", {"reason": reason} if reason else {})
