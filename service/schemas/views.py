"""The public views of jobs and events (what GET returns)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

if TYPE_CHECKING:
    from service.store.models import Job, JobEvent


JobStateName = Literal[
    "pending", "queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled"
]



class RankPlacementPublic(BaseModel):
    """Where one rank runs, as its actor reported it."""

    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    node_id: str = Field(description="Ray node id of the node the rank runs on.")
    node_name: str | None = Field(None, description="The node's name (its `node_name` label), e.g. r1-n2.")
    rack: str
    gpu: int = Field(description="GPU index on the node (-1 if Ray did not assign an index).")


class Progress(BaseModel):
    step: int = Field(description="Last completed optimizer step.")
    total_steps: int = Field(description="Steps the job will run.")
    loss: float | None = Field(None, description="Training loss at the last step.")
    tokens_per_s: float | None = Field(None, description="Training throughput.")
    mfu: float | None = Field(None, description="Measured model FLOPs utilisation.")


class JobPublic(BaseModel):
    id: str = Field(
        description="Job id (a ULID, sortable by creation time).", examples=["01JABCDEF0123456789ABCDEFG"]
    )
    tenant: str
    name: str
    state: JobStateName
    priority: int
    attempt: int = Field(description="Restarts so far.")
    version: int = Field(description="Bumped by every state change (compare-and-set).")
    spec: dict[str, Any] = Field(description="The normalised JobSpec.")
    plan: dict[str, Any] | None = Field(description="The planner's Plan (layout and its evidence).")
    progress: Progress
    result: dict[str, Any] | None = Field(description="Outputs of a finished job, e.g. the model digest.")
    placement: list[RankPlacementPublic] | None = Field(
        None, description="Where each rank runs, read back from the rank actors; null before the ranks start."
    )
    error: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @classmethod
    def from_row(cls, job: Job) -> JobPublic:
        return cls(
            id=job.id,
            tenant=job.tenant,
            name=job.name,
            state=job.state,
            priority=job.priority,  # type: ignore[arg-type]
            attempt=job.attempt,
            version=job.version,
            spec=job.spec,
            plan=job.plan,
            progress=Progress(
                step=job.step,
                total_steps=job.total_steps,
                loss=job.loss,
                tokens_per_s=job.tokens_per_s,
                mfu=job.mfu,
            ),
            result=job.result,
            placement=[RankPlacementPublic.model_validate(r) for r in job.placement or []] or None,
            error=job.error,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )


class JobPage(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class EventPublic(BaseModel):
    seq: int = Field(description="Position in the job's event log (1, 2, ...).")
    type: str = Field(
        description="created, state, progress, checkpoint, fault, plan, ...", examples=["state"]
    )
    time: dt.datetime
    payload: dict[str, Any]

    @classmethod
    def from_row(cls, event: JobEvent) -> EventPublic:
        return cls(seq=event.seq, type=event.type, time=event.time, payload=event.payload)


class EventPage(BaseModel):
    items: list[EventPublic]
    next_after: int | None = Field(
        description="Pass as `after` for the next page; null when there is no more."
    )
