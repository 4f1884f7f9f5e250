"""Reconciliation after a lost controller or a service restart: what the store says to do with a
job whose controller is gone (nothing, re-queue, fail it, or resume from its last checkpoint)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler.ingest import RECOVER_EVENT, attempts, count_events
from service.store.models import JobState
from workers.events import EventKind

# A job whose controller keeps vanishing (it cannot even start) is failed after this many recoveries.
MAX_CONTROLLER_RECOVERIES = 10


@dataclasses.dataclass(frozen=True)
class Relaunch:
    """A new controller to start for a job whose controller was lost."""

    spec: dict[str, Any]
    seq: int  # the last controller event seq stored: the new controller numbers on from it
    reached_step: int
    restarts_used: int  # its controllers' restarts (service restarts do not spend the fault budget)
    resume: str  # what it resumes from, for the log


def plan_recovery(sf: sessionmaker[Session], job_id: str, why: str) -> Relaunch | None:
    """Record the loss of the job's controller; returns the controller to start, or None when the
    job needs none (finished, back in the queue, or failed after too many losses)."""
    with store.session_scope(sf) as s:
        job = store.get_job(s, job_id)
        s.refresh(job)
        if JobState(job.state).terminal:
            return None
        if JobState(job.state) in (JobState.PENDING, JobState.QUEUED):
            # It held no GPUs (its controller was waiting for capacity): the queue starts it again.
            store.append_event(s, job_id, "controller_lost", {"reason": why})
            return None
        recoveries = count_events(s, job_id, (RECOVER_EVENT,))
        if recoveries >= MAX_CONTROLLER_RECOVERIES:
            store.transition(s, job_id, JobState.FAILED,
                             reason=f"controller lost {recoveries} times; last: {why}")
            return None
        ckpt = store.latest_checkpoint(s, job_id, verified_only=False)
        step = ckpt.step if ckpt is not None else None
        # The service knows the checkpoints it ingested; one committed after it stopped ingesting may be
        # newer. The ranks restore the newest that verifies against its manifest, so never an older one.
        resume = (f"its newest checkpoint that verifies (step {step} or later)" if step is not None
                  else "its newest checkpoint that verifies, if any (the service recorded none)")
        store.append_event(s, job_id, RECOVER_EVENT, {
            "reason": why, "checkpoint_step": step, "attempt": attempts(s, job_id) + 1,
            "message": f"{why}: a new controller resumes from {resume}",
        })
        if JobState(job.state) != JobState.RECOVERING:
            store.transition(s, job_id, JobState.RECOVERING, reason=why,
                             set_fields={"attempt": attempts(s, job_id)})
        return Relaunch(spec=dict(job.spec), seq=job.controller_seq, reached_step=job.step,
                        restarts_used=count_events(s, job_id, (EventKind.RESTART.value,)), resume=resume)


def unfinished_jobs(rsf: sessionmaker[Session]) -> list[tuple[str, JobState, int]]:
    """(job id, state, last controller seq stored) of every queued or active job, in queue order."""
    with rsf() as s:
        return [(j.id, JobState(j.state), j.controller_seq) for j in store.list_jobs(
            s, states=[JobState.QUEUED, *store.ACTIVE_STATES], limit=None, order="queue")]


def is_terminal(rsf: sessionmaker[Session], job_id: str) -> bool:
    """True if the store has the job and it is finished."""
    with rsf() as s:
        job = s.get(store.Job, job_id)
        return job is not None and JobState(job.state).terminal
