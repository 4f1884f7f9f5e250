"""Fault-tolerance metrics from a job controller's events and snapshot (issue 6).

The scheduler calls `observe_fault_events(job_id, new_events, snapshot)` once per poll with the
events it has not seen before. Restarts by cause, SDC detections and node health are counted by
the scheduler itself (service/scheduler.py); this adds the rest of the issue's list:

- time to detect (fault -> detection): the `time_to_detect_s` of each `failure` event;
- time to recover (detection -> first step after resume): each `resumed` event;
- steps lost: each `restore` event's `steps_lost`;
- goodput: useful step time over wall time since the controller started (`faults.goodput`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from service import metrics


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def observe_fault_events(job_id: str, events: Iterable[Mapping[str, Any]],
                         snapshot: Mapping[str, Any] | None = None) -> None:
    for e in events:
        kind = e.get("kind")
        if kind == "failure" and (ttd := _number(e.get("time_to_detect_s"))) is not None:
            metrics.JOB_TIME_TO_DETECT.labels(job_id).observe(ttd)
        elif kind == "resumed" and (ttr := _number(e.get("time_to_recover_s"))) is not None:
            metrics.JOB_TIME_TO_RECOVER.labels(job_id).observe(ttr)
        elif kind == "restore" and (lost := _number(e.get("steps_lost"))):
            metrics.JOB_STEPS_LOST.labels(job_id).inc(lost)
    faults = (snapshot or {}).get("faults") or {}
    if (goodput := _number(faults.get("goodput"))) is not None:
        metrics.JOB_GOODPUT.labels(job_id).set(goodput)
