"""The checkpoint period of a job whose spec leaves `checkpoint.every_steps` out: the optimum between
the time spent writing checkpoints and the work an interruption loses, from what the plan knows.

Young's first-order optimum (Young 1974, "A first order approximation to the optimum checkpoint
interval", CACM 17(9); Daly 2006, FGCS 22(3), eq. 37 to first order):

    interval = sqrt(2 * C * M)

C: seconds to write one checkpoint: each GPU's parameters and optimizer state (the plan's memory
model: a sharded layout writes its shard) at `checkpoint_write_gbps`, and at least
CHECKPOINT_FLOOR_S (the barrier, the manifest and its verification). M: the job's mean time between
interruptions, the per-GPU MTBF (`gpu_mtbf_hours`) over its GPUs. Steps: interval / the plan's
predicted step time, at least 1 and at most the job's steps (a checkpoint at the end is always
written). Explicit `every_steps` (0: only at the end) is never overridden.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CHECKPOINT_FLOOR_S = 1.0  # a checkpoint's fixed cost: barrier, manifest, verification
# Llama 3 (Llama Team 2024, Sec. 3.3.4): 419 unexpected interruptions in a 54-day snapshot of
# pre-training on 16,384 H100s, i.e. 54 * 24 * 16,384 / 419 = 50,676 GPU-hours per interruption.
LLAMA3_GPU_MTBF_HOURS = 50_676.0


def checkpoint_period(plan: Mapping[str, Any], steps: int, mtbf_hours: float,
                      write_gbps: float) -> dict[str, Any] | None:
    """{every_steps, interval_s, write_s, mtbf_s, why} for a plan; None when the plan predicts no step
    time (nothing to convert an interval into steps with)."""
    step_s = (plan.get("predicted") or {}).get("step_time_s")
    gpus = int((plan.get("cluster") or {}).get("num_gpus") or 0)
    if not isinstance(step_s, (int, float)) or step_s <= 0 or gpus <= 0 or steps <= 0:
        return None
    memory = plan.get("memory_per_gpu_bytes") or {}
    state = float(memory.get("params", 0)) + float(memory.get("optimizer", 0))
    write_s = max(CHECKPOINT_FLOOR_S, state / (write_gbps * 1e9))
    mtbf_s = mtbf_hours * 3600.0 / gpus
    interval_s = math.sqrt(2.0 * write_s * mtbf_s)  # Young 1974
    every = max(1, min(steps, round(interval_s / step_s)))
    why = (f"every {every} step(s): Young's optimum sqrt(2 C M) with C = {write_s:.3g} s to write "
           f"{state / 1e9:.3g} GB per GPU, M = {mtbf_s / 3600:.3g} h between interruptions on {gpus} GPUs "
           f"= {interval_s / 60:.3g} min at the predicted {step_s:.3g} s/step")
    return {"every_steps": every, "interval_s": round(interval_s, 3), "write_s": round(write_s, 3),
            "mtbf_s": round(mtbf_s, 1), "why": why}


def default_checkpoint_period(spec: Any, plan: Mapping[str, Any], settings: Any) -> dict[str, Any] | None:
    """`checkpoint_period` for a job spec (service.schemas.JobSpec) that leaves the period out; None
    when it sets one (0 included) or the plan cannot say."""
    if spec.checkpoint.every_steps is not None:
        return None
    return checkpoint_period(plan, spec.train.steps, settings.gpu_mtbf_hours, settings.checkpoint_write_gbps)


def shown_with_plan(spec: Any, plan: dict[str, Any], settings: Any) -> dict[str, Any]:
    """`plan` with the filled-in period under "checkpoint" (when the spec leaves it out), as a plan is
    stored and shown: at submit and when the scheduler re-plans; a job starts with it recomputed."""
    if (period := default_checkpoint_period(spec, plan, settings)) is not None:
        plan["checkpoint"] = period
    return plan
