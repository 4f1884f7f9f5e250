"""The public views of jobs and events (what GET returns)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

from service.performance import performance
from service.progress import goodput, memory_vs_plan

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


class Goodput(BaseModel):
    """Where the job's wall time since submission went, in seconds; the parts add up to it."""

    useful_s: float = Field(0.0, description="Step time of the steps kept.")
    startup_s: float = Field(0.0, description="From the start of the job's controller to its first step.")
    queued_s: float = Field(0.0, description="Waiting for GPUs (pending or queued).")
    restarting_s: float = Field(0.0, description="From a failure to the first step after it.")
    lost_s: float = Field(
        0.0, description="Running, but bought nothing kept: steps a restore threw away, time outside steps."
    )
    checkpoint_s: float = Field(0.0, description="Saving checkpoints.")


class Progress(BaseModel):
    step: int = Field(description="Last completed optimizer step.")
    total_steps: int = Field(description="Steps the job will run.")
    loss: float | None = Field(None, description="Training loss at the last step.")
    tokens_per_s: float | None = Field(None, description="Training throughput.")
    step_time_s: float | None = Field(None, description="Median wall time of the recent steps.")
    mfu: float | None = Field(
        None, description="Model FLOPs utilisation: measured, or the plan's FLOPs over the step time and "
        "the cluster's peak (the same value as the metric lattice_job_mfu)."
    )
    eta_s: float | None = Field(None, description="Seconds until the last step, once steps are timed.")
    val_loss: float | None = Field(
        None, description="Loss on the held-out split (data.validation) at its last evaluation."
    )
    val_step: int | None = Field(None, description="The step of that evaluation.")
    diverged_at: int | None = Field(
        None, description="The step whose loss was worse than a uniform guess over the vocabulary "
        "(1.5 x ln(vocab)): training diverged there (the `loss_diverged` event says why); None: it has not."
    )
    goodput: Goodput = Field(default_factory=Goodput)
    precision: str | None = Field(
        None, description="The precision the job trains in (train.precision, or the plan's default)."
    )
    memory: dict[str, Any] | None = Field(
        None, description="Bytes per rank from the first step (params, grads, optimizer, activations): "
        "`measured` (the largest rank's), `planned` (the plan's memory_per_gpu_bytes), `ratio`."
    )

    @classmethod
    def from_row(cls, job: Job, now: dt.datetime | None = None) -> Progress:
        doc = job.progress or {}
        end = job.finished_at or now or dt.datetime.now(dt.UTC)
        active = job.state in ("starting", "running", "recovering")
        return cls(
            step=job.step,
            total_steps=job.total_steps,
            loss=job.loss,
            tokens_per_s=job.tokens_per_s,
            step_time_s=doc.get("step_time_s"),
            mfu=job.mfu,
            eta_s=doc.get("eta_s") if active else None,
            val_loss=doc.get("val_loss"),
            val_step=doc.get("val_step"),
            diverged_at=doc.get("loss_diverged"),
            goodput=Goodput(**goodput(doc, created=job.created_at.timestamp(), end=end.timestamp())),
            precision=((job.plan or {}).get("train") or {}).get("precision"),
            memory=memory_vs_plan(job.plan, doc),
        )


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
    performance: dict[str, Any] | None = Field(
        None, description="Predicted vs measured (service.performance): `predicted` (step_time_s, "
        "tokens_per_s, mfu, terms_s), `measured` (medians after warm-up: step_time_s, tokens_per_s, mfu, "
        "phases_s, steps), `ratio` (measured / predicted step time) and `terms` (per time term); null "
        "without a plan.",
    )
    reason: str = Field(
        description="Why the job is in its state, e.g. 'queued: needs 4 GPUs, 2 free', 'recovering: "
        "rank(s) [3] died ... (on r1-n2)', 'running'.",
        examples=["running"],
    )
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
            progress=Progress.from_row(job),
            performance=performance(job.plan, job.progress),
            reason=job.reason or job.state,
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
