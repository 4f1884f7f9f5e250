"""The Lattice store: SQLAlchemy models and the functions every other component calls.

None of the functions commit; the caller owns the (short) transaction, e.g.

    with session_scope(factory) as session:
        job = transition(session, job_id, JobState.RUNNING, expected_version=v)
"""

from service.errors import ConcurrentUpdate, IllegalTransition, JobNotFound
from service.store.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    mark_checkpoint_verified,
    record_checkpoint,
)
from service.store.db import make_engine, make_session_factory, session_scope
from service.store.jobs import (
    LEGAL_TRANSITIONS,
    PREEMPT_TRANSITIONS,
    PREEMPTED_EVENT,
    RESUME_EVENT,
    RESUME_TRANSITIONS,
    append_event,
    count_jobs_by_state,
    create_job,
    get_job,
    list_events,
    list_jobs,
    new_job_id,
    requeue_preempted,
    resume_job,
    set_plan,
    transition,
    update_progress,
)
from service.store.models import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    ApiToken,
    Base,
    Checkpoint,
    IdempotencyKey,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeHealth,
    Role,
    Tenant,
)
from service.store.nodes import get_node, list_nodes, set_node_health, upsert_node
from service.store.tenants import ensure_tenant

__all__ = [
    "ACTIVE_STATES",
    "LEGAL_TRANSITIONS",
    "TERMINAL_STATES",
    "ApiToken",
    "Base",
    "Checkpoint",
    "ConcurrentUpdate",
    "IdempotencyKey",
    "IllegalTransition",
    "Job",
    "JobEvent",
    "JobNotFound",
    "JobState",
    "Node",
    "NodeHealth",
    "Role",
    "Tenant",
    "append_event",
    "count_jobs_by_state",
    "create_job",
    "ensure_tenant",
    "get_job",
    "get_node",
    "latest_checkpoint",
    "list_checkpoints",
    "list_events",
    "list_jobs",
    "list_nodes",
    "make_engine",
    "make_session_factory",
    "mark_checkpoint_verified",
    "new_job_id",
    "record_checkpoint",
    "session_scope",
    "set_node_health",
    "set_plan",
    "transition",
    "requeue_preempted",
    "resume_job",
    "RESUME_EVENT",
    "PREEMPT_TRANSITIONS",
    "PREEMPTED_EVENT",
    "RESUME_TRANSITIONS",
    "update_progress",
    "upsert_node",
]
