"""The metrics observer: Prometheus series from what the scheduler sees (controller snapshots and
events, the cluster, the queue).

Per job: step, loss, tokens/s, MFU (measured, or derived from the plan's FLOPs per step where the
ranks cannot name their device's peak), step time, checkpoint seconds and bytes, restarts by
cause, SDC detections, and the fault-tolerance series: time to detect (a `failure` event's
`time_to_detect_s`), time to recover (a `resumed` event's `time_to_recover_s`), steps lost (a
`restore` event's `steps_lost`) and goodput (the snapshot's `faults.goodput`: useful step time
over wall time since the controller started).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from service import metrics
from service.planner import GPU_CATALOG
from service.store.models import JobState
from workers.events import EventKind
from workers.topology import Topology

_NODE_STATES = ("ready", "suspect", "quarantined", "cordoned", "dead")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclasses.dataclass
class JobMetrics:
    """The metrics of one attached job, and what they need to remember between polls."""

    job_id: str
    # Model FLOPs per step over the cluster's peak FLOP/s (from the job's plan): measured MFU is
    # this over the step time, also where the ranks cannot name their device's peak (virtual GPUs).
    mfu_seconds: float | None = None
    step: int = 0
    failure_cause: str = "unknown"

    def observe(self, snap: Mapping[str, Any], events: list[dict[str, Any]]) -> None:
        p, job_id = snap["progress"], self.job_id
        step = p.get("step") or 0
        metrics.JOB_STEP.labels(job_id).set(step)
        for gauge, key in ((metrics.JOB_LOSS, "loss"), (metrics.JOB_TOKENS_PER_S, "tokens_per_s"),
                           (metrics.JOB_MFU, "mfu")):
            if isinstance(p.get(key), int | float):
                gauge.labels(job_id).set(p[key])
        step_time = p.get("step_time_s")
        measured = isinstance(p.get("mfu"), int | float)
        if not measured and self.mfu_seconds and isinstance(step_time, int | float) and step_time > 0:
            metrics.JOB_MFU.labels(job_id).set(self.mfu_seconds / step_time)
        if step > self.step and isinstance(p.get("step_time_s"), int | float):
            metrics.JOB_STEP_TIME.labels(job_id).observe(p["step_time_s"])
        self.step = step
        for e in events:
            self._observe_event(e)
        observe_fault_events(job_id, events, snap)

    def _observe_event(self, e: Mapping[str, Any]) -> None:
        job_id, kind = self.job_id, e["kind"]
        if kind == EventKind.CHECKPOINT_SAVED:
            if isinstance(e.get("seconds"), int | float):
                metrics.JOB_CHECKPOINT_SECONDS.labels(job_id).set(e["seconds"])
            if isinstance(e.get("bytes"), int | float):
                metrics.JOB_CHECKPOINT_BYTES.labels(job_id).set(e["bytes"])
        elif kind == EventKind.FAILURE:
            self.failure_cause = str((e.get("failure") or {}).get("kind", "unknown"))
        elif kind == EventKind.RESTART:
            metrics.JOB_RESTARTS.labels(job_id, self.failure_cause).inc()
            metrics.RESTARTS_BY_CAUSE.labels(self.failure_cause).inc()
        elif kind == EventKind.INTEGRITY_ERROR:
            metrics.JOB_SDC.labels(job_id).inc()
            metrics.SDC_DETECTIONS.inc()


def observe_fault_events(job_id: str, events: Iterable[Mapping[str, Any]],
                         snapshot: Mapping[str, Any] | None = None) -> None:
    """Time to detect, time to recover, steps lost and goodput from new events and a snapshot."""
    for e in events:
        kind = e.get("kind")
        if kind == EventKind.FAILURE and (ttd := _number(e.get("time_to_detect_s"))) is not None:
            metrics.JOB_TIME_TO_DETECT.labels(job_id).observe(ttd)
        elif kind == EventKind.RESUMED and (ttr := _number(e.get("time_to_recover_s"))) is not None:
            metrics.JOB_TIME_TO_RECOVER.labels(job_id).observe(ttr)
        elif kind == EventKind.RESTORE and (lost := _number(e.get("steps_lost"))):
            metrics.JOB_STEPS_LOST.labels(job_id).inc(lost)
    faults = (snapshot or {}).get("faults") or {}
    if (goodput := _number(faults.get("goodput"))) is not None:
        metrics.JOB_GOODPUT.labels(job_id).set(goodput)


def observe_launch(job_id: str, plan: Mapping[str, Any] | None) -> JobMetrics:
    """A job's controller started: its predicted MFU, and the metrics state for its polls."""
    predicted = ((plan or {}).get("predicted") or {}).get("mfu")
    if isinstance(predicted, int | float):
        metrics.JOB_MFU_PREDICTED.labels(job_id).set(predicted)
    return JobMetrics(job_id, mfu_seconds=mfu_seconds(plan))


def mfu_seconds(plan: Mapping[str, Any] | None) -> float | None:
    """flops_per_step / (GPUs x peak FLOP/s) of the planned cluster: MFU x step time."""
    plan = plan or {}
    cluster = plan.get("cluster") or {}
    gpu = GPU_CATALOG.get(str(cluster.get("gpu_type")))
    flops, gpus = plan.get("flops_per_step"), cluster.get("num_gpus")
    if gpu is None or not isinstance(flops, int | float) or not isinstance(gpus, int) or gpus < 1:
        return None
    return float(flops) / (gpus * gpu.peak_flops)


def observe_cluster(topology: Topology) -> None:
    """GPUs total and free, and each node's health (the ledger's, merged into the topology)."""
    for n in topology.gpu_nodes:
        metrics.GPUS_TOTAL.labels(n.name, n.rack).set(n.gpus_total)
        metrics.GPUS_FREE.labels(n.name, n.rack).set(n.gpus_free if n.alive else 0)
        shown = "cordoned" if n.cordoned and n.health in ("ready", "suspect") else n.health
        for state in _NODE_STATES:
            metrics.NODE_HEALTH.labels(n.name, n.rack, state).set(1 if state == shown else 0)
    metrics.NODES_QUARANTINED.set(sum(1 for n in topology.gpu_nodes if n.health == "quarantined"))


def observe_queue(counts: Mapping[JobState, int]) -> None:
    """Jobs by state and the queue depth (pending + queued)."""
    for state, n in counts.items():
        metrics.JOBS_BY_STATE.labels(state.value).set(n)
    metrics.QUEUE_DEPTH.set(counts[JobState.PENDING] + counts[JobState.QUEUED])
