"""What the scheduler does with a job's measured performance (service.performance): one
`plan_mismatch` event when the step time is far off the prediction, and, once a job without faults
succeeds, the planner's feedback (service.planner.feedback) into the hardware profile its plan used,
recorded as a `planner_feedback` event. Plain functions over a session."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from service import store
from service.performance import PLAN_MISMATCH_EVENT, mismatch, performance
from service.planner.feedback import compute_factor, compute_seconds, predicted_after, refine_profile
from service.store.models import Job
from workers.events import EventKind

log = logging.getLogger(__name__)

FEEDBACK_EVENT = "planner_feedback"
# Any of these in a job's log means it had a fault: its step times say nothing about the plan.
FAULT_EVENTS = (
    EventKind.FAILURE.value, EventKind.RESTART.value, EventKind.RESTORE.value,
    EventKind.INTEGRITY_ERROR.value,
    EventKind.NODE_SUSPECT.value, EventKind.NODE_QUARANTINED.value, EventKind.NODE_DEAD.value,
    EventKind.STRAGGLER.value, EventKind.FAST_PATH_FAILED.value, EventKind.FAULT_INJECTED.value,
    "recover", store.RESUME_EVENT,
)


def check_mismatch(s: Session, job: Job, doc: dict[str, Any]) -> None:
    """Append the job's one `plan_mismatch` event when its measured step time is off (marks `doc`)."""
    if doc.get(PLAN_MISMATCH_EVENT):
        return
    found = mismatch(performance(job.plan, doc))
    if found is not None:
        doc[PLAN_MISMATCH_EVENT] = round(found["ratio"], 4)
        store.append_event(s, job.id, PLAN_MISMATCH_EVENT, found)


def had_faults(s: Session, job: Job) -> bool:
    return job.attempt > 0 or bool(store.list_events(s, job.id, limit=1, types=FAULT_EVENTS))


def learn_from(s: Session, job: Job, doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The feedback of a job that just succeeded (None when it has nothing to teach: no measured
    steps, or faults); stores the refined profile when the plan used one that is stored."""
    plan = job.plan or {}
    perf = performance(plan, doc)
    if perf is None or perf["measured"] is None:
        return None
    if had_faults(s, job):
        log.info("planner feedback: job %s had faults; its measurement is ignored", job.id)
        return None
    m, p = perf["measured"]["step_time_s"], perf["predicted"]["step_time_s"]
    compute = compute_seconds(plan)
    factor = compute_factor(m, p, compute)
    out: dict[str, Any] = {
        "message": f"measured/predicted {m / p:.3g}: compute efficiency x{factor:.3g}",
        "measured_step_time_s": m, "predicted_step_time_s": p, "compute_s": compute, "factor": factor,
        "predicted_after_s": predicted_after(p, compute, factor), "profile": plan.get("profile"),
        "new_version": None,
    }
    ref = plan.get("profile")
    if isinstance(ref, Mapping) and factor != 1.0:
        out["new_version"] = _store_refined(s, ref, factor, job.id, m / p)
    store.append_event(s, job.id, FEEDBACK_EVENT, out)
    return out


def _store_refined(s: Session, ref: Mapping[str, Any], factor: float, job_id: str,
                   ratio: float) -> int | None:
    """A new version of the profile `ref` names (its node type's latest), if the profile store has it."""
    try:
        from service.store import profiles
    except ImportError:  # no profile store in this build: the event records the factor alone
        return None
    current = profiles.newest_profile(s, str(ref.get("node_type")))
    if current is None:
        return None
    refined = refine_profile(current.to_dict(), factor, job_id=job_id, ratio=ratio)
    return profiles.save_profile(s, refined).version
