"""Predicted vs measured: a job's plan (service.planner.result.Plan.to_dict) next to what its ranks
measured (`progress["perf"]`, kept by the controller: workers.controller.perf), per step and per
time term. Pure functions over the stored JSON documents; the API (`performance` of
GET /v1/jobs/{id}), `lattice status`, `lattice plan --explain-against`, the `plan_mismatch` event
and the planner's feedback (service.planner.feedback) all read these.

The ranks time the phases of a step (training.phase_timer): forward + backward (`compute`; with
pp > 1 the whole pipeline schedule), the data-parallel gradient sync wait (`dp_sync`), the optimizer
step (`optimizer`), and the small rest (data, integrity checks, the per-step loss summary). So the
plan's exposed DP and optimizer terms compare one to one; compute, recompute, exposed TP/CP/EP and
the pipeline bubble all run inside forward + backward and compare as one group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.progress import mfu_seconds

PLAN_MISMATCH_EVENT = "plan_mismatch"
MISMATCH_FACTOR = 1.5  # measured step time more than this many times off the prediction, either way
MIN_MEASURED_STEPS = 3  # steps after warm-up before a mismatch is called
# The plan's time terms (Plan.time_breakdown_s keys) and their names for people.
TERM_NAMES = {
    "compute": "compute",
    "recompute": "recompute",
    "tp": "exposed TP",
    "cp": "exposed CP",
    "ep": "EP all-to-all",
    "pp_p2p": "PP point-to-point",
    "bubble": "PP bubble",
    "dp_exposed": "exposed DP",
    "optimizer": "optimizer",
}
# Terms that run inside the timed forward + backward phase.
FORWARD_BACKWARD_TERMS = ("compute", "recompute", "tp", "cp", "ep", "pp_p2p", "bubble")
# The measured phase each separately timed term compares with.
_PHASE_OF = {"dp_exposed": "dp_sync", "optimizer": "optimizer"}
_NOT_SEPARABLE = {
    "recompute": "not separately measurable: recomputation runs inside forward + backward",
    "tp": "not separable: TP all-reduces run inside forward + backward",
    "cp": "not separable: the CP ring runs inside forward + backward",
    "ep": "not separable: the all-to-all runs inside forward + backward",
    "pp_p2p": "not separable: inside the pipeline schedule (forward + backward)",
    "bubble": "not separable: the pipeline schedule is timed as a whole (forward + backward)",
}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def predicted(plan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The plan's step time, tokens/s, MFU and time terms (None without a prediction)."""
    pred = (plan or {}).get("predicted") or {}
    step = _num(pred.get("step_time_s"))
    if step is None or step <= 0:
        return None
    breakdown = (plan or {}).get("time_breakdown_s") or {}
    terms = {k: float(v) for k, v in breakdown.items() if _num(v) is not None}
    return {"step_time_s": step, "tokens_per_s": _num(pred.get("tokens_per_s")), "mfu": _num(pred.get("mfu")),
            "terms_s": terms}


def measured(plan: Mapping[str, Any] | None, doc: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Medians after warm-up from the ranks (None before a step after warm-up): step time, tokens/s
    (global batch x seq_len over it), MFU (the plan's FLOPs per step over the cluster's peak and
    it), and the phase times."""
    perf = (doc or {}).get("perf") or {}
    step = _num(perf.get("step_time_s"))
    if step is None or step <= 0:
        return None
    train = (plan or {}).get("train") or {}
    g, s = _num(train.get("global_batch")), _num(train.get("seq_len"))
    per_step = mfu_seconds(plan)
    return {"step_time_s": step, "tokens_per_s": g * s / step if g and s else None,
            "mfu": per_step / step if per_step else None, "steps": int(perf.get("steps") or 0),
            "warmup_steps": perf.get("warmup_steps"),
            "phases_s": {k: float(v) for k, v in (perf.get("phases_s") or {}).items() if _num(v) is not None}}


def term_rows(pred: Mapping[str, Any], meas: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Predicted and measured seconds per term: one row per plan term, the forward + backward group
    (what is timed as one phase), the rest of the step (measured only) and the step itself."""
    terms = pred.get("terms_s") or {}
    phases = (meas or {}).get("phases_s") or {}
    fb_phase = phases.get("compute")
    others_zero = all(terms.get(k, 0.0) == 0.0 for k in FORWARD_BACKWARD_TERMS if k != "compute")
    rows: list[dict[str, Any]] = []
    fb_pred = sum(terms.get(k, 0.0) for k in FORWARD_BACKWARD_TERMS)
    for key, name in TERM_NAMES.items():
        if key == "dp_exposed":  # the group's total before the separately timed terms
            rows.append(_row("forward_backward", "forward + backward (the terms above)", fb_pred, fb_phase,
                             None))
        if key not in terms:
            continue
        m, note = None, None
        if key == "compute":
            m = fb_phase if others_zero else None
            note = None if others_zero else "timed with the rest of forward + backward (see that row)"
        elif key in _PHASE_OF:
            m = phases.get(_PHASE_OF[key])
        elif terms[key] > 0 or key in ("recompute", "bubble", "tp"):
            note = _NOT_SEPARABLE[key]
        else:
            continue
        rows.append(_row(key, name, terms[key], m, note))
    if not any(r["term"] == "forward_backward" for r in rows):
        rows.append(_row("forward_backward", "forward + backward (the terms above)", fb_pred, fb_phase, None))
    if meas is not None:
        timed = sum(phases.get(p, 0.0) for p in ("compute", "dp_sync", "optimizer"))
        rest = max(0.0, float(meas["step_time_s"]) - timed)
        overhead = terms.get("overhead") or None  # the calibrated loop overhead (costmodel.finish)
        rows.append(_row("other", "other (data, integrity checks, loss summary)", overhead, rest,
                         None if overhead else "not in the plan"))
    rows.append(_row("step", "step", float(pred["step_time_s"]), (meas or {}).get("step_time_s"), None))
    return rows


def _row(key: str, name: str, p: float | None, m: float | None, note: str | None) -> dict[str, Any]:
    ratio = m / p if p and m is not None and p > 0 else None
    return {"term": key, "name": name, "predicted_s": p, "measured_s": m, "ratio": ratio, "note": note}


def performance(plan: Mapping[str, Any] | None, doc: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`{predicted, measured, ratio, terms}` of a job (ratio: measured / predicted step time)."""
    pred = predicted(plan)
    if pred is None:
        return None
    meas = measured(plan, doc)
    ratio = meas["step_time_s"] / pred["step_time_s"] if meas else None
    out: dict[str, Any] = {"predicted": pred, "measured": meas, "ratio": ratio,
                           "terms": term_rows(pred, meas)}
    profile = (plan or {}).get("profile")
    if isinstance(profile, Mapping):
        out["profile"] = dict(profile)
    return out


def biggest_term(pred: Mapping[str, Any]) -> str | None:
    terms = pred.get("terms_s") or {}
    return max(terms, key=lambda k: terms[k]) if terms else None


def mismatch(perf: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The `plan_mismatch` event's payload when the measured step time is more than
    MISMATCH_FACTOR off the prediction (either way) over at least MIN_MEASURED_STEPS steps."""
    steps = (perf or {}).get("measured") or {}
    if not perf or perf.get("ratio") is None or steps.get("steps", 0) < MIN_MEASURED_STEPS:
        return None
    ratio = float(perf["ratio"])
    if 1 / MISMATCH_FACTOR <= ratio <= MISMATCH_FACTOR:
        return None
    pred, meas = perf["predicted"], perf["measured"]
    term = biggest_term(pred)
    name = TERM_NAMES.get(term or "", term or "?")
    share = pred["terms_s"][term] / pred["step_time_s"] if term else 0.0
    way = "slower" if ratio > 1 else "faster"
    times = ratio if ratio > 1 else 1 / ratio
    message = (f"measured {meas['step_time_s'] * 1e3:.4g} ms/step is {times:.2f}x {way} than the "
               f"predicted {pred['step_time_s'] * 1e3:.4g} ms; the prediction's biggest term is "
               f"{name} ({share:.0%} of it)")
    return {"message": message, "ratio": ratio, "predicted_step_time_s": pred["step_time_s"],
            "measured_step_time_s": meas["step_time_s"], "biggest_term": term, "biggest_term_name": name,
            "steps": meas["steps"]}
