"""The metrics observer: Prometheus series from what the scheduler sees (controller snapshots and
events, the cluster, the queue).

Per job (labels `job_id`, `job_name`, `tenant`): step, loss, tokens/s, MFU and goodput as the
ingest derived them (`publish`; service.progress: measured MFU, or the plan's FLOPs per step where
the ranks cannot name their device's peak; the goodput parts and their ratio), step time,
checkpoint seconds and bytes, restarts by cause, SDC detections, and the fault-tolerance series:
time to detect (a `failure` event's `time_to_detect_s`), time to recover (a `resumed` event's
`time_to_recover_s`) and steps lost (a `restore` event's `steps_lost`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from service import metrics
from service.progress import goodput_ratio
from service.store.models import JobState
from workers.events import EventKind
from workers.topology import Topology

_NODE_STATES = ("ready", "suspect", "quarantined", "cordoned", "dead")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclasses.dataclass(frozen=True)
class Derived:
    """What the ingest derived from a snapshot for one job, exported as it is stored."""

    mfu: float | None
    parts: Mapping[str, float]
    predicted_mfu: float | None = None
    step_time_predicted: float | None = None  # the plan's step time (service.performance)
    step_time_measured: float | None = None  # the ranks' median after warm-up


# Job id -> what the ingest derived from its last snapshot, read by that job's next `observe`.
_DERIVED: dict[str, Derived] = {}


def publish(job_id: str, job_name: str, tenant: str, derived: Derived) -> None:
    """The ingest's numbers for a job (service.progress: MFU and the goodput parts; the plan's
    predicted MFU), so that the metrics say what the API says; names the job's series."""
    metrics.name_job(job_id, job_name, tenant)
    _DERIVED[job_id] = derived


@dataclasses.dataclass
class JobMetrics:
    """The metrics of one attached job, and what they need to remember between polls."""

    job_id: str
    step: int = 0
    failure_cause: str = "unknown"
    spares: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the last snapshot's

    def observe(self, snap: Mapping[str, Any], events: list[dict[str, Any]]) -> None:
        p, labels = snap["progress"], metrics.job_labels(self.job_id)
        step = p.get("step") or 0
        metrics.JOB_STEP.labels(*labels).set(step)
        gauges = ((metrics.JOB_LOSS, "loss"), (metrics.JOB_VAL_LOSS, "val_loss"),
                  (metrics.JOB_TOKENS_PER_S, "tokens_per_s"))
        for gauge, key in gauges:
            if isinstance(p.get(key), int | float):
                gauge.labels(*labels).set(p[key])
        derived = _DERIVED.pop(self.job_id, None)
        if derived is not None:
            _observe_derived(labels, derived)
        if step > self.step and isinstance(p.get("step_time_s"), int | float):
            metrics.JOB_STEP_TIME.labels(*labels).observe(p["step_time_s"])
        self.step = step
        for e in events:
            self._observe_event(labels, e)
        observe_fault_events(self.job_id, events, snap)
        self.spares = [dict(s) for s in snap.get("spares") or []]
        observe_spares(labels, self.spares)
        warm = snap.get("warm_processes") or {}
        metrics.JOB_WARM_PROCESSES.labels(*labels).set(sum(_number(n) or 0 for n in warm.values()))

    def _observe_event(self, labels: tuple[str, str, str], e: Mapping[str, Any]) -> None:
        kind = e["kind"]
        if kind == EventKind.CHECKPOINT_SAVED:
            if isinstance(e.get("seconds"), int | float):
                metrics.JOB_CHECKPOINT_SECONDS.labels(*labels).set(e["seconds"])
            if isinstance(e.get("bytes"), int | float):
                metrics.JOB_CHECKPOINT_BYTES.labels(*labels).set(e["bytes"])
        elif kind == EventKind.FAILURE:
            self.failure_cause = str((e.get("failure") or {}).get("kind", "unknown"))
        elif kind == EventKind.RESTART:
            metrics.JOB_RESTARTS.labels(*labels, self.failure_cause).inc()
            metrics.RESTARTS_BY_CAUSE.labels(self.failure_cause).inc()
        elif kind == EventKind.INTEGRITY_ERROR:
            metrics.JOB_SDC.labels(*labels).inc()
            metrics.SDC_DETECTIONS.inc()
        elif kind == EventKind.PREEMPTED:
            metrics.PREEMPTIONS.inc()
            metrics.STEPS_LOST_TO_PREEMPTION.inc(_number(e.get("steps_lost")) or 0)


def _observe_derived(labels: tuple[str, str, str], derived: Derived) -> None:
    if derived.mfu is not None:
        metrics.JOB_MFU.labels(*labels).set(derived.mfu)
    if derived.predicted_mfu is not None:
        metrics.JOB_MFU_PREDICTED.labels(*labels).set(derived.predicted_mfu)
    if derived.step_time_predicted is not None:
        metrics.JOB_STEP_TIME_PREDICTED.labels(*labels).set(derived.step_time_predicted)
    if derived.step_time_measured is not None:
        metrics.JOB_STEP_TIME_MEDIAN.labels(*labels).set(derived.step_time_measured)
    for part, seconds in derived.parts.items():
        metrics.JOB_GOODPUT_SECONDS.labels(*labels, part.removesuffix("_s")).set(seconds)
    if (ratio := goodput_ratio(derived.parts)) is not None:
        metrics.JOB_GOODPUT.labels(*labels).set(ratio)


def observe_fault_events(job_id: str, events: Iterable[Mapping[str, Any]],
                         snapshot: Mapping[str, Any] | None = None) -> None:
    """Time to detect, time to recover and steps lost from new events (goodput comes from the
    service's own accounting: `publish`)."""
    labels = metrics.job_labels(job_id)
    for e in events:
        kind = e.get("kind")
        if kind == EventKind.FAILURE and (ttd := _number(e.get("time_to_detect_s"))) is not None:
            metrics.JOB_TIME_TO_DETECT.labels(*labels).observe(ttd)
        elif kind == EventKind.RESUMED and (ttr := _number(e.get("time_to_recover_s"))) is not None:
            metrics.JOB_TIME_TO_RECOVER.labels(*labels).observe(ttr)
        elif kind == EventKind.RESTORE and (lost := _number(e.get("steps_lost"))) is not None:
            metrics.JOB_STEPS_LOST_PER_FAULT.labels(*labels).observe(lost)
            if lost:
                metrics.JOB_STEPS_LOST.labels(*labels).inc(lost)
        elif kind == EventKind.REPLANNED:
            metrics.JOB_RECOVERIES.labels(*labels, "replan").inc()
        elif kind == EventKind.RESTART:
            metrics.JOB_RECOVERIES.labels(*labels, "peer" if e.get("path") == "peer" else "checkpoint").inc()
            if (took := _number(e.get("replacement_s"))) is not None:
                spare = "true" if e.get("spare_used") else "false"
                metrics.JOB_REPLACEMENT_SECONDS.labels(*labels, spare).observe(took)


def observe_spares(labels: tuple[str, str, str], spares: Iterable[Mapping[str, Any]]) -> None:
    """The job's hot spares by state and the oldest one's age (workers.spares, from its snapshot)."""
    spares = list(spares)
    for state in ("starting", "warm"):
        metrics.JOB_SPARES.labels(*labels, state).set(sum(1 for s in spares if s.get("state") == state))
    oldest = max((_number(s.get("age_s")) or 0.0 for s in spares), default=0.0)
    metrics.JOB_SPARE_AGE.labels(*labels).set(oldest)


def observe_launch(job_id: str, plan: Mapping[str, Any] | None) -> JobMetrics:
    """A job's controller started: the metrics state for its polls (its plan's numbers, such as the
    predicted MFU, come with each snapshot's `publish`)."""
    del plan
    return JobMetrics(job_id)


def observe_cluster(topology: Topology) -> None:
    """GPUs total and free, and each node's health (the ledger's, merged into the topology)."""
    for n in topology.gpu_nodes:
        metrics.GPUS_TOTAL.labels(n.name, n.rack).set(n.gpus_total)
        # Free means a new rank may land there: none on a dead, quarantined or cordoned node.
        metrics.GPUS_FREE.labels(n.name, n.rack).set(n.gpus_free if n.schedulable else 0)
        shown = "cordoned" if n.cordoned and n.health in ("ready", "suspect") else n.health
        for state in _NODE_STATES:
            metrics.NODE_HEALTH.labels(n.name, n.rack, state).set(1 if state == shown else 0)
    metrics.NODES_QUARANTINED.set(sum(1 for n in topology.gpu_nodes if n.health == "quarantined"))


def observe_queue(counts: Mapping[JobState, int]) -> None:
    """Jobs by state and the queue depth (pending + queued)."""
    for state, n in counts.items():
        metrics.JOBS_BY_STATE.labels(state.value).set(n)
    metrics.QUEUE_DEPTH.set(counts[JobState.PENDING] + counts[JobState.QUEUED])
