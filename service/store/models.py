"""The tables of the Lattice store (SQLAlchemy 2.0 typed models).

Migrations in `migrations/versions` must produce exactly these tables; a test runs Alembic's
autogenerate against both SQLite and PostgreSQL and expects no difference.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class JobState(enum.StrEnum):
    PENDING = "pending"
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES: frozenset[JobState] = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RECOVERING})


class NodeHealth(enum.StrEnum):
    READY = "ready"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    CORDONED = "cordoned"
    DEAD = "dead"


class Role(enum.StrEnum):
    ADMIN = "admin"
    USER = "user"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite hands back naive values)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(dt.UTC) if value is not None else None

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value


# JSONB on PostgreSQL (indexable, compact), plain JSON text elsewhere.
JSONType = JSON().with_variant(JSONB(), "postgresql")
# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def _in(column: str, values: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: UTCDateTime, dict[str, Any]: JSONType}


class Tenant(Base):
    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    max_priority: Mapped[int | None] = mapped_column(Integer)  # None: the service default cap
    gpu_quota: Mapped[int | None] = mapped_column(Integer)  # GPUs its running jobs may hold; None: no cap
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))  # fair-share weight
    # May run on idle GPUs beyond its quota (such jobs are marked borrowing and are reclaimable).
    borrowing: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class ApiToken(Base):
    """A bearer token. Only the SHA-256 of the token is stored; the token itself is shown once."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint(_in("role", Role), name="role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    description: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None]
    expires_at: Mapped[dt.datetime | None]  # None: never expires
    last_used_at: Mapped[dt.datetime | None]


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("state", JobState), name="state"),
        Index("ix_jobs_tenant_state", "tenant", "state"),
        Index("ix_jobs_state_priority", "state", "priority"),
    )

    # Time-ordered ULID: the API lists newest first by id and pages with it.
    id: Mapped[str] = mapped_column(String(26), primary_key=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"))
    name: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any] | None]
    state: Mapped[str] = mapped_column(String(16), default=JobState.PENDING.value)
    # Compare-and-set counter: bumped by every state transition (service.store.jobs.transition).
    version: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # Progress, written by the job controller; not versioned (it does not change the state).
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    mfu: Mapped[float | None] = mapped_column(Float)
    result: Mapped[dict[str, Any] | None]
    # Where each rank runs, read back from the rank actors: [{rank, pp, dp, cp, tp, node_id, node_name,
    # rack, gpu}]; written by the scheduler with the progress.
    placement: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    # Last job-controller event seq stored (the scheduler resumes polling after it).
    controller_seq: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)  # why the job is in its state, for people
    progress: Mapped[dict[str, Any] | None]  # progress beyond step/loss/tokens_per_s/mfu (eta, goodput, ...)
    # Allocates job_events.seq atomically (UPDATE ... RETURNING), see store.jobs.append_event.
    event_seq: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)


class JobEvent(Base):
    """Append-only history of a job: state changes, progress milestones, faults, checkpoints."""

    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    type: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]]
    time: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    verified: Mapped[bool] = mapped_column(Boolean, default=False)
    manifest_digest: Mapped[str | None] = mapped_column(String(128))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (CheckConstraint(_in("health", NodeHealth), name="health"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)  # the Ray node id
    hostname: Mapped[str] = mapped_column(String(255), default="")
    rack: Mapped[str] = mapped_column(String(64), default="")
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    health: Mapped[str] = mapped_column(String(16), default=NodeHealth.READY.value)
    fault_count: Mapped[int] = mapped_column(Integer, default=0)
    last_fault: Mapped[str | None] = mapped_column(Text)
    fault_jobs: Mapped[list[str] | None] = mapped_column(JSONType)  # jobs whose faults counted here
    # Why the node drains (an admin's drain, through any API replica): the leading scheduler notifies
    # its jobs; cleared by uncordon.
    drain_reason: Mapped[str | None] = mapped_column(Text)
    last_fault_at: Mapped[dt.datetime | None]
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class IdempotencyKey(Base):
    """(tenant, key) -> the job a request created; the unique constraint settles concurrent retries."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("tenant", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(ForeignKey("tenants.name"))
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class SchedulerLease(Base):
    """A leader lease (service.scheduler.leader): who acts, since when, and the term that fences the
    writes of a deposed holder (every fenced transaction checks the term it was elected with)."""

    __tablename__ = "scheduler_leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(255))  # 'host:pid'; None: released, free to take
    term: Mapped[int] = mapped_column(Integer, default=0)  # +1 on every change of holder
    since: Mapped[dt.datetime] = mapped_column(default=utcnow)  # when this term began
    renewed_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(default=utcnow)  # for people; takeover uses local clocks


class HardwareProfileRecord(Base):
    """A measured hardware profile of one node type (`lattice calibrate`); versions count up per type.
    The document is service.planner.efficiency.HardwareProfile's JSON (service.store.profiles)."""

    __tablename__ = "hardware_profiles"
    __table_args__ = (UniqueConstraint("node_type", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_type: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    profile: Mapped[dict[str, Any]]
