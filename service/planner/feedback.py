"""Learning from jobs: a finished job's measured step time refines the compute efficiency of the
hardware profile its plan used (pure Python; the scheduler applies it: service.scheduler.learning).

The update (docs/planner.md, "Learning from jobs"). With predicted step time P, its compute part
C (forward + backward compute, the part that scales with the efficiency curve) and the measured
step time M, the efficiency factor that would make the prediction exact is

    f* = C / (C + M - P)        (C / f* + (P - C) = M; f* = MAX_STEP when M <= P - C)

The curve moves a fraction ALPHA of the way in log space, f = exp(ALPHA * ln f*), clamped to
[1 / MAX_STEP, MAX_STEP] per update. Since 0 < ALPHA <= 1, |ln f| <= |ln f*|: the new prediction
lies between the old one and the measurement, never beyond it. Every achieved rate of the
profile's compute curves (matmul points of its compute dtype, attention points) is multiplied by f.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

ALPHA = 0.3  # fraction of the log-space distance to the measurement covered by one job
MAX_STEP = 2.0  # at most a 2x change of the efficiency per update, either way
# Terms of a plan that scale with the compute efficiency (Plan.time_breakdown_s keys).
COMPUTE_TERMS = ("compute", "recompute")


def compute_factor(measured_s: float, predicted_s: float, compute_s: float, *, alpha: float = ALPHA,
                   max_step: float = MAX_STEP) -> float:
    """The multiplier of the achieved compute rates after one job (1.0: no change)."""
    if not (0.0 < alpha <= 1.0) or max_step < 1.0:
        raise ValueError("feedback: alpha must be in (0, 1] and max_step >= 1")
    if measured_s <= 0 or predicted_s <= 0 or compute_s <= 0:
        return 1.0
    rest = compute_s + measured_s - predicted_s
    target = max_step if rest <= 0 else compute_s / rest
    step = math.exp(alpha * math.log(min(max(target, 1.0 / max_step), max_step)))
    # Never past the measurement: the step is on the same side of 1 as the target and no larger.
    return min(step, target) if target >= 1.0 else max(step, target)


def predicted_after(predicted_s: float, compute_s: float, factor: float) -> float:
    """The prediction once the compute rates are multiplied by `factor`."""
    return predicted_s - compute_s + compute_s / factor


def update_curve(curve: Sequence[Sequence[float]], measured_s: float, predicted_s: float, compute_s: float, *,
                 alpha: float = ALPHA, max_step: float = MAX_STEP) -> list[tuple[float, ...]]:
    """A curve of points whose last element is an achieved rate (FLOP/s), e.g. matmul (m, n, k, rate),
    with every rate multiplied by `compute_factor(...)`."""
    f = compute_factor(measured_s, predicted_s, compute_s, alpha=alpha, max_step=max_step)
    return [(*pt[:-1], float(pt[-1]) * f) for pt in curve]


def compute_seconds(plan: Mapping[str, Any]) -> float:
    """The part of a plan's predicted step time that scales with the compute efficiency."""
    terms = plan.get("time_breakdown_s") or {}
    return sum(float(terms.get(k) or 0.0) for k in COMPUTE_TERMS)


def refine_profile(doc: Mapping[str, Any], factor: float, *, job_id: str, ratio: float) -> dict[str, Any]:
    """The next version of a stored profile (HardwareProfile.to_dict form): compute curves scaled by
    `factor`, the version bumped, and the update recorded in `meta.feedback` (last 20)."""
    out = dict(doc)
    dtype = str(doc.get("compute_dtype") or "")
    matmul = {d: [list(p) for p in pts] for d, pts in (doc.get("matmul") or {}).items()}
    for d, pts in matmul.items():
        if d == dtype or len(matmul) == 1:
            matmul[d] = [[*p[:-1], float(p[-1]) * factor] for p in pts]
    out["matmul"] = matmul
    out["attention"] = [[*p[:-1], float(p[-1]) * factor] for p in doc.get("attention") or []]
    out["version"] = int(doc.get("version") or 0) + 1
    meta = dict(doc.get("meta") or {})
    history = list(meta.get("feedback") or [])
    history.append({"job_id": job_id, "from_version": int(doc.get("version") or 0), "factor": factor,
                    "measured_over_predicted": ratio})
    meta["feedback"] = history[-20:]
    out["meta"] = meta
    return out
