"""Controller reports -> the store: events (with checkpoint rows and node faults), progress, the
placement, and the job's state moved along legal store transitions. Plain functions over a
session: no threads, no controller calls."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.performance import performance
from service.progress import advance, checkpoint_seconds, goodput, mfu_seconds
from service.scheduler import divergence, learning, observer
from service.store.jobs import LEGAL_TRANSITIONS
from service.store.models import Job, JobEvent, JobState
from service.store.nodes import record_node_fault
from workers.client import ControllerState
from workers.events import EventKind

# The service's own event type for a lost controller that a new one replaces.
RECOVER_EVENT = "recover"
# Event types that count as an attempt (Job.attempt): a controller's restart after a fault, the
# recovery of a lost controller by the reconciler, and an explicit resume (POST .../resume).
ATTEMPT_EVENTS = (EventKind.RESTART.value, RECOVER_EVENT, store.RESUME_EVENT)
MAX_LOSSES_IN_RESULT = 1000
# Controller states in which the placement the snapshot reports is the one the ranks run on.
PLACED_STATES = frozenset({ControllerState.RUNNING, ControllerState.CHECKPOINTING})


# ---- job states -------------------------------------------------------------------------------------
def job_transition_path(current: JobState, target: JobState) -> list[JobState]:
    """The legal store transitions that take a job from `current` to the controller's `target`.

    The controller reports `starting` while it places and starts ranks; the store's `starting`
    is set by the scheduler when it launches the controller, so `starting` from the controller
    never moves a job back: a queued job (its controller retrying placement) stays queued, a
    recovering one stays recovering, and a running one (whose restart fell between two polls)
    becomes recovering. Otherwise the shortest legal path (queued -> starting -> running; a job
    that finished between two polls: starting -> running -> succeeded)."""
    if current == target or current.terminal:
        return []
    if target == JobState.STARTING:
        return [JobState.RECOVERING] if current == JobState.RUNNING else []
    seen = {current}
    queue: deque[tuple[JobState, list[JobState]]] = deque([(current, [])])
    while queue:
        state, path = queue.popleft()
        for nxt in sorted(LEGAL_TRANSITIONS[state], key=lambda s: s.value):
            if nxt in seen or (nxt.terminal and nxt != target):
                continue
            if nxt == target:
                return [*path, nxt]
            seen.add(nxt)
            queue.append((nxt, [*path, nxt]))
    raise AssertionError(f"no legal path from {current} to {target}")


def count_events(s: Session, job_id: str, types: tuple[str, ...]) -> int:
    return int(s.scalar(select(func.count()).select_from(JobEvent).where(
        JobEvent.job_id == job_id, JobEvent.type.in_(types))) or 0)


def attempts(s: Session, job_id: str) -> int:
    """Restarts so far: the controllers' restarts plus the recoveries of lost controllers."""
    return count_events(s, job_id, ATTEMPT_EVENTS)


def mirror_state(s: Session, job: Job, snap: Mapping[str, Any]) -> None:
    """Move the job along legal edges to the job state its controller reports."""
    target = JobState(snap["job_state"])
    if snap["state"] == ControllerState.PREEMPTED:  # back to the queue, to resume from its checkpoint
        if JobState(job.state) in store.PREEMPT_TRANSITIONS:
            step = snap["progress"].get("preempted_at")
            store.requeue_preempted(s, job.id, step=int(step or 0), reason=snap.get("reason") or "preempted")
        return
    for step_state in job_transition_path(JobState(job.state), target):
        fields: dict[str, Any] = {"attempt": attempts(s, job.id)}
        reason = f"controller {snap['state']}"
        if step_state == JobState.SUCCEEDED:
            fields["result"] = summarize_result(snap.get("result") or {}, snap["progress"])
            reason = "all ranks finished"
        elif step_state == JobState.FAILED:
            reason = snap.get("reason") or "the controller failed the job"
            if snap.get("traceback"):  # the failing rank's last traceback, under the reason
                fields["error"] = f"{reason}\n\n{snap['traceback']}"
        elif step_state == JobState.QUEUED and snap.get("reason"):
            reason = f"waiting for capacity: {snap['reason']}"
        store.transition(s, job.id, step_state, reason=reason, set_fields=fields)


# ---- one snapshot ------------------------------------------------------------------------------------
def write_snapshot(sf: sessionmaker[Session], job_id: str, seen_seq: int, snap: Mapping[str, Any],
                   new_events: list[dict[str, Any]], *, feedback: bool = True) -> tuple[int, JobState]:
    """Write one controller snapshot into the store in one transaction: the events after the
    last stored seq, progress, the placement, the job's state. Returns the last controller seq
    stored and the job's state before this snapshot. `feedback` (settings.planner_feedback): a job
    that succeeds without faults refines its plan's hardware profile (service.scheduler.learning)."""
    with store.session_scope(sf) as s:
        job = store.get_job(s, job_id)
        s.refresh(job)
        floor = max(seen_seq, job.controller_seq)
        for event in new_events:
            if event["seq"] > floor:
                store_controller_event(s, job, event)
        last_seq = max([floor, *(e["seq"] for e in new_events)])
        current = JobState(job.state)
        if not current.terminal:
            progress = snap["progress"]
            fields: dict[str, Any] = {"controller_seq": last_seq}
            for key in ("loss", "tokens_per_s"):
                if progress.get(key) is not None:
                    fields[key] = progress[key]
            if progress.get("step") is not None:
                fields["step"] = int(progress["step"])
            if ControllerState(snap["state"]) in PLACED_STATES or snap["terminal"]:
                if snap["placement"] and snap["placement"] != job.placement:
                    fields["placement"] = snap["placement"]
            derived, reason = _progress_fields(s, job, snap, [e for e in new_events if e["seq"] > floor])
            learning.check_mismatch(s, job, derived["progress"])
            divergence.check(s, job, derived["progress"], progress.get("loss"), progress.get("step"))
            succeeds = JobState(snap["job_state"]) == JobState.SUCCEEDED
            if feedback and succeeds and "feedback" not in derived["progress"]:
                derived["progress"]["feedback"] = learning.learn_from(s, job, derived["progress"])
            store.update_progress(s, job_id, **fields, **derived)
            mirror_state(s, job, snap)
            if reason is not None:  # after the transitions: each sets a reason of its own
                store.update_progress(s, job_id, reason=reason)
    return last_seq, current


# ---- progress, goodput and the reason --------------------------------------------------------------
def _progress_fields(s: Session, job: Job, snap: Mapping[str, Any],
                     events: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The progress document (service.progress) and MFU, and the reason (None in a terminal state),
    with the job in the state this snapshot moves it to; hands the same numbers to the metrics
    observer."""
    now = time.time()
    path = job_transition_path(JobState(job.state), JobState(snap["job_state"]))
    after = path[-1] if path else JobState(job.state)
    created = job.created_at.timestamp()
    start = now if job.progress else _controller_started(s, job.id, default=now)
    plan_mfu = mfu_seconds(job.plan)
    doc = advance(job.progress, state=after.value, snap=snap, now=now, start=start, created=created,
                           plan_mfu_seconds=plan_mfu, checkpoint_seconds=checkpoint_seconds(events))
    for e in events:
        if e.get("kind") == EventKind.FAILURE:
            nodes = [str(n) for n in (e.get("failure") or {}).get("nodes") or []]
            where = f" (on {', '.join(nodes)})" if nodes else ""
            doc["failure"] = f"{e.get('message') or (e.get('failure') or {}).get('kind')}{where}"[:500]
    predicted = ((job.plan or {}).get("predicted") or {}).get("mfu")
    perf = performance(job.plan, doc) or {}
    observer.publish(job.id, job.name, job.tenant, observer.Derived(
        doc["mfu"], goodput(doc, created=created, end=now),
        float(predicted) if isinstance(predicted, int | float) else None,
        step_time_predicted=(perf.get("predicted") or {}).get("step_time_s"),
        step_time_measured=(perf.get("measured") or {}).get("step_time_s")))
    return {"progress": doc, "mfu": doc["mfu"]}, None if after.terminal else state_reason(after, snap, doc)


def _controller_started(s: Session, job_id: str, default: float) -> float:
    """When the scheduler last moved the job to `starting` (its controller was started)."""
    for event in reversed(store.list_events(s, job_id, limit=None, types=["state"])):
        if event.payload.get("to") == JobState.STARTING.value:
            return event.time.timestamp()
    return default


def state_reason(state: JobState, snap: Mapping[str, Any], doc: Mapping[str, Any]) -> str:
    """Why an active job is in its state, for people: "queued: ...", "recovering: rank(s) [3] died
    ... (on r1-n2)", "running"."""
    controller = str(snap.get("state"))
    if state == JobState.QUEUED:
        return f"queued: {snap.get('reason') or 'waiting for GPUs'}"
    if state == JobState.RECOVERING:
        return f"recovering: {doc.get('failure') or 'restarting the ranks'}"
    if doc.get("phase") == "startup":
        what = {"INIT": "reserving GPUs", "PLACING": "reserving GPUs", "STARTING": "starting the ranks"}
        return f"starting: {what.get(controller, 'waiting for the first step')}"
    if state == JobState.STARTING:
        return "starting"
    if doc.get("phase") == "restarting":
        return "running: waiting for the first step after a restart"
    return "running"


# ---- controller events -----------------------------------------------------------------------------
def store_controller_event(s: Session, job: Job, event: Mapping[str, Any]) -> None:
    """Append one controller event to the job's log, with its side effects (checkpoint rows, node
    faults). A committed checkpoint is stored as the checkpoint row and its `checkpoint` event."""
    kind = str(event["kind"])
    payload = {k: v for k, v in event.items() if k not in ("seq", "kind")}
    payload["cseq"] = event["seq"]
    if kind == EventKind.CHECKPOINT_SAVED:
        step = int(event["step"])
        verified = event.get("verified")
        if not isinstance(verified, bool):
            # The engine checks integrity before a step's save and stops instead of saving when it fails.
            every = int(((job.spec or {}).get("fault_tolerance") or {}).get("sdc_check_every", 0) or 0)
            verified = bool(every) and step % every == 0
        store.record_checkpoint(s, job.id, step, str(event.get("path") or ""), verified=verified,
                                bytes=int(event.get("bytes") or 0))
        return
    if kind == EventKind.CHECKPOINT_VERIFIED and isinstance(event.get("verified"), bool):
        _mark_checkpoint(s, job.id, int(event["step"]), event["verified"])
    elif kind == EventKind.FAILURE and (event.get("failure") or {}).get("kind") == "checkpoint":
        step = (event.get("failure") or {}).get("step")
        if isinstance(step, int):
            _mark_checkpoint(s, job.id, step, False)  # a damaged checkpoint is never restored
    elif kind == EventKind.REPLANNED and isinstance(event.get("new_layout"), dict) and job.plan:
        # The controller re-planned for the capacity left; a later recovery must use the new layout.
        plan = {**job.plan, "layout": event["new_layout"], "replanned_from": event.get("old_layout"),
                "planned_layout": job.plan.get("planned_layout") or job.plan.get("layout")}  # growing back
        store.set_plan(s, job.id, plan, reason=str(event.get("message") or "replanned by the controller"))
        s.refresh(job)
    elif kind in (EventKind.NODE_SUSPECT, EventKind.NODE_QUARANTINED) and event.get("node"):
        # The node ledger across jobs: one job's faults make a node suspect; a second job's, or a
        # confirmed hardware signal from the controller, quarantine it.
        record_node_fault(s, str(event["node"]), job.id, f"job {job.id}: {event.get('message', kind)}",
                          confirmed=kind == EventKind.NODE_QUARANTINED)
    store.append_event(s, job.id, "controller_state" if kind == EventKind.STATE else kind[:32], payload)


def _mark_checkpoint(s: Session, job_id: str, step: int, verified: bool) -> None:
    if any(c.step == step for c in store.list_checkpoints(s, job_id)):
        store.mark_checkpoint_verified(s, job_id, step, verified)


def summarize_result(result: Mapping[str, Any], progress: Mapping[str, Any]) -> dict[str, Any]:
    """The job row's `result`: the digest, the losses of the last attempt, the final checkpoint."""
    losses = [x for x in result.get("losses") or [] if isinstance(x, int | float)]
    resumed = result.get("resumed_from")
    checkpoints = list(result.get("checkpoints") or [])
    out: dict[str, Any] = {
        "model_digest": result.get("model_digest"),
        "final_step": result.get("final_step"),
        "resumed_from": resumed,
        "restarts": result.get("restarts", 0),
        "layout": result.get("layout"),
        "loss_first": losses[0] if losses else None,
        "loss_first_step": (resumed or 0) + 1 if losses else None,
        "loss_last": losses[-1] if losses else None,
        "tokens_per_s": progress.get("tokens_per_s"),
        "step_time_s": progress.get("step_time_s"),
        "checkpoint": checkpoints[-1] if checkpoints else None,
    }
    if len(losses) <= MAX_LOSSES_IN_RESULT:
        out["losses"] = losses
    return out
