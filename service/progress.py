"""A job's progress document (the `jobs.progress` column) and where its wall time went.

Pure functions, no I/O: the scheduler's ingest folds each controller snapshot into the document
(`advance`), the API reads it back (`goodput`), and the metrics observer exports the same
numbers, so `progress.mfu` and `lattice_job_mfu` are one value.

Goodput. Every second since submission belongs to exactly one phase, measured by the scheduler as
it polls: `queued` (pending or queued), `startup` (from the start of the job's controller until
its first step: placement, rank actors, rendezvous, model build), `restarting` (from a failure
until the first step after it) and `running` (the rest). At read time `running` splits into
`useful_s` (the step time of the steps kept, as the controller's books say), `checkpoint_s`
(checkpoint saves) and `lost_s` (steps thrown away by a restore, and the running time outside
timed steps), so the six parts add up to the wall time since submission.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from service.planner import GPU_CATALOG

RECENT_STEPS = 20  # step_time_s is the median of this many recent step times
PHASES = ("queued", "startup", "restarting", "running")
GOODPUT_PARTS = ("useful_s", "startup_s", "queued_s", "restarting_s", "lost_s", "checkpoint_s")
# Job states (store values) -> the phase their time counts in.
_STATE_PHASE = {"pending": "queued", "queued": "queued", "starting": "startup", "recovering": "restarting",
                "running": "running"}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def mfu_seconds(plan: Mapping[str, Any] | None) -> float | None:
    """flops_per_step / (GPUs x peak FLOP/s) of the planned cluster: MFU x step time. The plan's own
    (its predicted MFU x step time: the peak of the hardware profile it used) where it has them, so
    that measured and predicted MFU share one peak; else the catalogue's peak."""
    plan = plan or {}
    pred = plan.get("predicted") or {}
    mfu, step = _number(pred.get("mfu")), _number(pred.get("step_time_s"))
    if mfu is not None and step is not None and mfu > 0 and step > 0:
        return mfu * step
    cluster = plan.get("cluster") or {}
    gpu = GPU_CATALOG.get(str(cluster.get("gpu_type")))
    flops, gpus = plan.get("flops_per_step"), cluster.get("num_gpus")
    if gpu is None or not isinstance(flops, int | float) or not isinstance(gpus, int) or gpus < 1:
        return None
    return float(flops) / (gpus * gpu.peak_flops)


def memory_vs_plan(plan: Mapping[str, Any] | None, progress: Mapping[str, Any] | None
                   ) -> dict[str, Any] | None:
    """The peak rank's measured bytes per term next to the plan's memory_per_gpu_bytes, and their
    ratios (None until the ranks reported their first step)."""
    measured = ((progress or {}).get("memory") or {}).get("measured")
    if not isinstance(measured, Mapping) or not measured:
        return None
    planned = (plan or {}).get("memory_per_gpu_bytes") or {}
    ratio = {k: v / planned[k] for k, v in measured.items()
             if isinstance(planned.get(k), int | float) and planned[k] > 0}
    return {"measured": dict(measured), "planned": {k: planned[k] for k in measured if k in planned},
            "ratio": ratio}


def job_mfu(progress: Mapping[str, Any], plan_mfu_seconds: float | None) -> float | None:
    """The ranks' measured MFU, or (where they cannot name their device's peak, e.g. virtual GPUs)
    the plan's FLOPs per step over the cluster's peak and the last step time."""
    measured = _number(progress.get("mfu"))
    if measured is not None:
        return measured
    step_time = _number(progress.get("step_time_s"))
    if plan_mfu_seconds and step_time and step_time > 0:
        return plan_mfu_seconds / step_time
    return None


def advance(doc: Mapping[str, Any] | None, *, state: str, snap: Mapping[str, Any], now: float,
            start: float, created: float, plan_mfu_seconds: float | None,
            checkpoint_seconds: float = 0.0) -> dict[str, Any]:
    """Fold one controller snapshot, taken at `now` with the job in store `state` (after the
    snapshot moved it), into the progress document. `start` is when the job's controller was
    started (used on the first snapshot: the time before it was queued) and `checkpoint_seconds`
    the save time of the checkpoints committed since the last snapshot."""
    out: dict[str, Any] = {k: v for k, v in (doc or {}).items()}
    phases = {p: float((out.get("phases") or {}).get(p, 0.0)) for p in PHASES}
    if "t" not in out:  # the first snapshot: the job waited from submission until its controller started
        phases["queued"] = max(0.0, start - created)
        out.update(t=max(start, created), phase="startup", mark_step=0)
    p = snap.get("progress") or {}
    step = int(p.get("step") or 0)
    step_time = _number(p.get("step_time_s"))
    recent = [float(x) for x in out.get("recent") or []]
    if step_time is not None and step != out.get("last_step") and step > 0:
        recent = [*recent, step_time][-RECENT_STEPS:]
    dt = max(0.0, now - float(out["t"]))
    phase, new = str(out.get("phase", "running")), _STATE_PHASE.get(state, "running")
    waiting_first_step = phase in ("startup", "restarting") and new == "running"
    if waiting_first_step and out.get("mark_step") is not None and step == out["mark_step"]:
        new = phase  # the ranks are up but no step is done yet: still starting or restarting
    if waiting_first_step and new == "running":
        done = max(1, step - int(out.get("mark_step") or 0))
        ran = min(dt, (step_time or 0.0) * done)  # the first steps themselves are running time
        phases["running"] += ran
        phases[phase] += dt - ran
    else:
        phases[phase] += dt
    if new in ("startup", "restarting") and phase != new:
        out["mark_step"] = step  # leaves the phase once the step moves on from here
    elif new == "running":
        out["mark_step"] = None
    out.update(t=now, phase=new, phases=phases, recent=recent, last_step=step,
               checkpoint=float(out.get("checkpoint") or 0.0) + max(0.0, checkpoint_seconds))
    _count_useful(out, snap.get("faults") or {})
    out["step_time_s"] = statistics.median(recent) if recent else None
    out["mfu"] = job_mfu(p, plan_mfu_seconds)
    total = int(p.get("total_steps") or 0)
    out["eta_s"] = round(max(0, total - step) * out["step_time_s"], 3) if recent and total else None
    if isinstance(p.get("perf"), Mapping):  # medians after warm-up (workers.controller.perf)
        out["perf"] = dict(p["perf"])
    if isinstance(p.get("memory"), Mapping):  # the ranks' memory accounts (workers.controller.ingest)
        out["memory"] = {k: v for k, v in p["memory"].items() if k in ("ranks", "measured")}
    if p.get("val_loss") is not None:  # the held-out loss, from the last validation (data.validation)
        out["val_loss"], out["val_step"] = float(p["val_loss"]), int(p.get("val_step") or step)
    return out


def _count_useful(out: dict[str, Any], faults: Mapping[str, Any]) -> None:
    """Useful step time: the controller's books (a restore drops the steps it throws away). A new
    controller (the old one was lost) starts its books afresh: what the old one counted is kept."""
    wall, useful = _number(faults.get("wall_seconds")), _number(faults.get("useful_step_seconds"))
    if wall is None or useful is None:
        return
    base = float(out.get("useful_base") or 0.0)
    if wall < float(out.get("controller_wall") or 0.0):
        base += float(out.get("controller_useful") or 0.0)
    out.update(useful_base=base, controller_wall=wall, controller_useful=useful, useful=base + useful)


def goodput(doc: Mapping[str, Any] | None, *, created: float, end: float) -> dict[str, float]:
    """The six goodput parts (seconds) at `end` (now, or when the job finished): the phases the
    scheduler measured, the time since its last snapshot in the current phase, and `running` split
    into useful, checkpoint and lost time."""
    doc = doc or {}
    if "t" not in doc:  # never started: all of it was spent waiting
        waited = max(0.0, end - created)
        return {**dict.fromkeys(GOODPUT_PARTS, 0.0), "queued_s": round(waited, 3)}
    phases = {p: float((doc.get("phases") or {}).get(p, 0.0)) for p in PHASES}
    phases[str(doc.get("phase", "running"))] += max(0.0, end - float(doc["t"]))
    running = phases["running"]
    useful = min(float(doc.get("useful") or 0.0), running)
    checkpoint = min(float(doc.get("checkpoint") or 0.0), running - useful)
    parts = {"useful_s": useful, "startup_s": phases["startup"], "queued_s": phases["queued"],
             "restarting_s": phases["restarting"], "lost_s": running - useful - checkpoint,
             "checkpoint_s": checkpoint}
    return {k: round(v, 3) for k, v in parts.items()}


def goodput_ratio(parts: Mapping[str, float]) -> float | None:
    """Useful step time over the time since the job's first step (queue and start-up excluded:
    they are their own parts); None before there is any."""
    denominator = sum(parts[k] for k in ("useful_s", "restarting_s", "lost_s", "checkpoint_s"))
    return round(min(parts["useful_s"] / denominator, 1.0), 4) if denominator > 0 else None


def checkpoint_seconds(events: Iterable[Mapping[str, Any]]) -> float:
    """Save time of the checkpoints committed in these controller events."""
    return sum(_number(e.get("seconds")) or 0.0 for e in events if e.get("kind") == "checkpoint_saved")
