"""The planner's entry points: the search over layouts (`plan`) and the prediction for one fixed
layout (`evaluate`).

Enumeration, outermost first: tp (divides the node and the heads), cp (divides the sequence, stays in
a rack), pp (any degree up to the layer count; uneven splits give the busiest rank ceil(L/(p v))
layers), dp = N / (tp cp pp) (divides the global batch), ep (MoE only), micro-batch size (m follows),
sequence parallel, recomputation, schedule (and interleaving depth v), ZeRO stage (ZeRO-2/3 also with
the family's one HSDP split, candidates.hsdp_replicas). Each level computes only what it adds
(costmodel.py), and a candidate whose pipeline time alone is already slower than its family's best is
not finished. The fastest candidate wins; exact ties go to no HSDP, then less traffic, then the lower
ZeRO stage, then less memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from service.planner.candidates import DEFAULT_SCHEDULES, CandidateSearch, candidate_layout, detail_for
from service.planner.costmodel import Env
from service.planner.errors import PlannerError
from service.planner.explain import alternative, explain, hsdp_note, too_big_message
from service.planner.result import Plan, build_detail, describe, fmt_bytes
from service.planner.specs import ClusterSpec, TrainSpec
from training.config.layout import MULTI_STAGE_SCHEDULES, SCHEDULES, Layout
from training.config.spec import ModelSpec

log = logging.getLogger(__name__)


def _check(value: Iterable[Any], allowed: Iterable[Any], name: str) -> tuple[Any, ...]:
    vals = tuple(value)
    allowed = tuple(allowed)
    if not vals or any(v not in allowed for v in vals) or len(set(vals)) != len(vals):
        raise PlannerError(
            f"{name} must be a non-empty list of distinct values from {list(allowed)}, got {list(vals)}"
        )
    return vals


def plan(
    model: ModelSpec,
    train: TrainSpec,
    cluster: ClusterSpec,
    *,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    top_k: int = 5,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
) -> Plan:
    """The fastest predicted layout for `model` on `cluster`, with alternatives and reasons.

    Raises PlannerError for bad input, and when no layout fits (naming the smallest cluster that does).
    """
    zs = _check(zero_stages, (0, 1, 2, 3), "zero_stages")
    schs = _check(schedules, [s for s in SCHEDULES if s != "none"], "schedules")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= 100:
        raise PlannerError(f"top_k must be an integer between 0 and 100, got {top_k!r}")
    env = _env(model, train, cluster)
    search = CandidateSearch(env, zs, schs)
    search.run()
    if search.best is None:
        raise PlannerError(too_big_message(env, search, zs, schs))
    return plan_from_search(env, search, zs, top_k)


def plan_from_search(env: Env, search: CandidateSearch, zs: Sequence[int], top_k: int) -> Plan:
    """The Plan of a finished search (search.best is set): its layout, alternatives and reasons."""
    assert search.best is not None
    step, z, _, stage, micro, combo = search.best
    detail = build_detail(stage, micro, combo, z, candidate_layout(stage, micro, combo, z))
    result = Plan.from_detail(detail, mode="search", env=env)
    result.candidates_evaluated = search.evaluated
    result.rejected = search.rejected
    others = [c for k, c in search.fam_best.items() if k != stage.fam.key()]
    for c in sorted(others, key=lambda c: c[0])[:top_k]:
        d = build_detail(c[3], c[4], c[5], c[1], candidate_layout(c[3], c[4], c[5], c[1]))
        result.alternatives.append(alternative(env, d, detail))
    result.reasons = explain(env, detail, result, search, zs)
    log.debug(
        "planned %s on %d %s: %s in %d candidates",
        env.model.name,
        env.n,
        env.gpu.name,
        describe(detail.layout),
        search.evaluated,
    )
    return result


def _env(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> Env:
    if not isinstance(model, ModelSpec):
        raise PlannerError(f"model must be a training.config.spec.ModelSpec, got {type(model).__name__}")
    if not isinstance(train, TrainSpec):
        raise PlannerError(f"train must be a TrainSpec, got {type(train).__name__}")
    if not isinstance(cluster, ClusterSpec):
        raise PlannerError(f"cluster must be a ClusterSpec, got {type(cluster).__name__}")
    return Env(model, train, cluster)


def evaluate(
    model: ModelSpec,
    train: TrainSpec,
    cluster: ClusterSpec,
    layout: Layout,
    *,
    compare_with_search: bool = False,
) -> Plan:
    """The prediction for a fixed layout; the same numbers the search computes for it.

    Layouts the search would not choose still get a prediction (reasons say why they are unusual,
    `fits` is False when over capacity); layouts that cannot run on this model and cluster raise
    PlannerError. With compare_with_search, the reasons also name the search's best layout.
    """
    if not isinstance(layout, Layout):
        raise PlannerError(f"layout must be a training.config.layout.Layout, got {type(layout).__name__}")
    env = _env(model, train, cluster)
    d = detail_for(env, layout)
    result = Plan.from_detail(d, mode="evaluate", env=env)
    result.candidates_evaluated = 1
    reasons = [
        f"evaluated {describe(layout)}: {result.step_time_s:.4g} s/step, MFU {result.mfu:.1%}, "
        f"{fmt_bytes(d.memory['total'])} of {fmt_bytes(env.capacity)} per GPU"
    ]
    if not d.fits:
        reasons.append(
            f"does not fit: needs {fmt_bytes(d.memory['total'])} > {fmt_bytes(env.capacity)} per GPU"
        )
    hsdp = hsdp_note(d)
    if hsdp:
        reasons.append(hsdp)
    if layout.tp > env.gpn or env.gpn % layout.tp:
        reasons.append(
            f"tp={layout.tp} crosses the {env.gpn}-GPU node: its all-reduces run on the {d.tiers['tp']} tier"
        )
    if env.model.layers % layout.num_stages:
        reasons.append(
            f"uneven pipeline split: {env.model.layers} layers over {layout.num_stages} stages; the "
            f"busiest rank holds {math.ceil(env.model.layers / layout.num_stages) * layout.virtual_stages}"
        )
    if layout.schedule in MULTI_STAGE_SCHEDULES and layout.num_microbatches % layout.pp:
        reasons.append(
            f"num_microbatches ({layout.num_microbatches}) is not a multiple of pp ({layout.pp}), which "
            f"interleaved schedules usually need"
        )
    if compare_with_search:
        try:
            best = plan(model, train, cluster, top_k=0)
            faster = result.step_time_s / best.step_time_s - 1.0
            reasons.append(
                f"the search's best layout {describe(best.layout)} predicts {best.step_time_s:.4g} s/step; "
                f"this layout is {faster:.1%} slower"
            )
        except PlannerError as e:
            reasons.append(f"search found nothing to compare: {e}")
    result.reasons = reasons
    return result
