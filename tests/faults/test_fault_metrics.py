"""The scheduler turns a controller's fault events into the issue's metrics on /metrics."""

from __future__ import annotations

from prometheus_client import generate_latest

from service import metrics
from service.scheduler.observer import observe_fault_events

# Shaped like the controller (workers.controller) emits them (kind + the numbers they carry).
EVENTS = [
    {"seq": 1, "kind": "failure", "failure": {"kind": "rank_died"}, "time_to_detect_s": 0.8},
    {"seq": 2, "kind": "restore", "step": 10, "steps_lost": 2},
    {"seq": 3, "kind": "resumed", "step": 11, "time_to_recover_s": 4.2},
]


def _sample(name: str, job_id: str) -> float:
    for family in metrics.REGISTRY.collect():
        for s in family.samples:
            if s.name == name and s.labels.get("job_id") == job_id:
                return s.value
    raise AssertionError(f"{name}{{job_id={job_id}}} not exposed")


def test_fault_events_become_metrics_and_leave_with_the_job() -> None:
    job = "fm-1"
    metrics.name_job(job, "fm", "team-a")
    observe_fault_events(job, EVENTS, {"faults": {"goodput": 0.75}})
    assert _sample("lattice_job_time_to_detect_seconds_count", job) == 1
    assert _sample("lattice_job_time_to_detect_seconds_sum", job) == 0.8
    assert _sample("lattice_job_time_to_recover_seconds_sum", job) == 4.2
    assert _sample("lattice_job_steps_lost_total", job) == 2
    observe_fault_events(job, [{"kind": "restore", "steps_lost": 0}, {"kind": "step"}], None)
    assert _sample("lattice_job_steps_lost_total", job) == 2  # nothing lost, nothing counted
    assert _sample("lattice_job_steps_lost_per_fault_count", job) == 2  # ...but a fault that lost 0
    assert _sample("lattice_job_steps_lost_per_fault_sum", job) == 2
    observe_fault_events(job, [{"kind": "restart", "path": "peer"}, {"kind": "restart", "path": "fast"},
                               {"kind": "restart", "path": "full"}, {"kind": "replanned"}], None)
    paths = {s.labels["path"]: s.value for f in metrics.REGISTRY.collect() for s in f.samples
             if s.name == "lattice_job_recoveries_total" and s.labels.get("job_id") == job}
    assert paths == {"peer": 1, "checkpoint": 2, "replan": 1}
    metrics.forget_job(job)
    assert f'job_id="{job}"' not in generate_latest(metrics.REGISTRY).decode()
