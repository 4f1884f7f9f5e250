"""Partial layouts: any subset of Layout's fields is given, the planner chooses the rest.

`plan_layout` is the one entry every way in uses (a job's `parallelism`, `POST /v1/plans`'s `layout`,
`lattice plan --layout`):

- nothing given (`parallelism: auto`): the search (`plan`);
- the given fields with Layout's defaults for the others already make a layout that runs this model
  on this cluster and batch: that layout is evaluated, exactly as an explicit layout always was;
- otherwise the search runs over the layouts that keep every given field (a given degree is taken
  even where the search would not choose it for speed); the fastest wins, and the reasons say what
  was chosen for each field that was not given and why;
- when no layout keeps them all, `LayoutRefused` gives the reason and the nearest layout that works:
  the fastest plan that keeps the most given fields, with each numeric field it could not keep
  moved to the nearest value that works (a refused tp=3 suggests tp=4 or tp=2, not whatever degree
  the unconstrained search finds fastest).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from service.planner.candidates import (
    DEFAULT_SCHEDULES,
    MAX_CANDIDATES,
    CandidateSearch,
    detail_for,
    hsdp_replicas,
    validate_layout,
)
from service.planner.costmodel import Env
from service.planner.errors import PlannerError
from service.planner.result import Plan, describe, fmt_bytes
from service.planner.search import _check, _env, evaluate, plan, plan_from_search
from service.planner.specs import ClusterSpec, TrainSpec
from training.config.layout import MULTI_STAGE_SCHEDULES, RECOMPUTE, SCHEDULES, Layout, LayoutError
from training.config.spec import ModelSpec
from training.config.validate import check_layout_for_model

LAYOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Layout))
DEGREES: tuple[str, ...] = ("tp", "cp", "pp", "dp")
# Constrained searches one refusal may run to find the nearest working layout (each drops a
# different set of given fields); beyond it the nearest is the unconstrained plan.
MAX_NEAREST_SEARCHES = 48
# Numeric fields a refusal moves to the nearest working value, and the values tried per field.
_MOVABLE: tuple[str, ...] = ("tp", "cp", "pp", "dp", "ep", "dp_replicate", "micro_batch_size",
                             "num_microbatches", "virtual_stages")
MAX_MOVE_TRIES = 4
_FAST = "the fastest predicted"
_ALLOWED: dict[str, tuple[Any, ...]] = {
    "zero_stage": (0, 1, 2, 3),
    "schedule": SCHEDULES,
    "recompute": RECOMPUTE,
}


class LayoutRefused(PlannerError):
    """A partial layout no layout can keep: `reason`, and `nearest` (a Plan keeping `kept`, with the
    given fields in `moved` changed to the nearest values that work) or None."""

    def __init__(self, reason: str, given: dict[str, Any], nearest: Plan | None, kept: tuple[str, ...],
                 moved: Mapping[str, int] | None = None):
        self.reason, self.given, self.nearest, self.kept = reason, given, nearest, kept
        self.moved = dict(moved or {})
        msg = f"{given_text(given)} cannot work: {reason}"
        if nearest is not None:
            keeps = given_text({k: given[k] for k in kept}) if kept else "none of the given fields"
            moves = ", ".join(f"{k}={v} (given {given[k]})" for k, v in self.moved.items())
            moves = f"; the nearest values that work: {moves}" if moves else ""
            msg += f"; the nearest layout that works is {describe(nearest.layout)} (keeps {keeps}{moves})"
        else:
            msg += "; no layout works on this cluster at this global batch"
        super().__init__(msg)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def given_text(given: Mapping[str, Any]) -> str:
    return ",".join(f"{k}={_fmt(v)}" for k, v in given.items())


def normalize_given(given: Mapping[str, Any] | Layout) -> dict[str, Any]:
    """The given fields in Layout's order (None = not given); PlannerError for an unknown field."""
    if isinstance(given, Layout):
        return given.to_dict()
    unknown = sorted(set(given) - set(LAYOUT_FIELDS))
    if unknown:
        raise PlannerError(
            f"layout: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(LAYOUT_FIELDS)}"
        )
    fields = {k: given[k] for k in LAYOUT_FIELDS if given.get(k) is not None}
    for name, value in fields.items():
        allowed = _ALLOWED.get(name)
        if allowed is not None and (isinstance(value, bool) or value not in allowed):
            raise PlannerError(f"layout.{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        if allowed is None and name != "sequence_parallel" and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise PlannerError(f"layout.{name} must be an integer >= 1, got {value!r}")
        if name == "sequence_parallel" and not isinstance(value, bool):
            raise PlannerError(f"layout.sequence_parallel must be true or false, got {value!r}")
    return fields


def _defaults(given: Mapping[str, Any]) -> Layout | None:
    """The given fields with Layout's defaults for the rest, when that is a valid Layout."""
    try:
        return Layout(**given)
    except (LayoutError, TypeError):
        return None


def layout_gpus(model: ModelSpec, given: Mapping[str, Any] | Layout, global_batch: int, fallback: int) -> int:
    """GPUs a (partial) layout asks for when the request names none: the world size of the layout
    as given (Layout's defaults for the rest) when that runs the model and batch (as always), else
    tp x pp x dp x cp when tp, pp and dp are all given, else `fallback` (the cluster's GPUs)."""
    fields = normalize_given(given)
    layout = _defaults(fields)
    if layout is not None and layout.global_batch == global_batch:
        try:
            check_layout_for_model(model, layout)
            return layout.world_size
        except LayoutError:
            pass
    if all(k in fields for k in ("tp", "pp", "dp")):
        return math.prod(fields.get(k, 1) for k in DEGREES)
    return fallback


def plan_layout(
    model: ModelSpec,
    train: TrainSpec,
    cluster: ClusterSpec,
    given: Mapping[str, Any] | Layout | None = None,
    *,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    top_k: int = 5,
    compare_with_search: bool = False,
    gpus_from: str = "cluster.num_gpus",
    allow_unfit: bool = False,
) -> Plan:
    """The Plan for `given` (None = search everything). Raises PlannerError for bad input and
    LayoutRefused (a PlannerError) when no layout keeps every given field. `gpus_from` names where
    the GPU count came from, for messages. `allow_unfit` (a job's admin-only `allow_unfit`): a partial
    layout whose every completion is over GPU memory is completed as if memory were unbounded, and
    that layout evaluated (`fits` False), as a given layout that does not fit always was."""
    if given is None:
        return plan(model, train, cluster, zero_stages=zero_stages, top_k=top_k)
    fields = normalize_given(given)
    zs = _check(zero_stages, (0, 1, 2, 3), "zero_stages")
    env = _env(model, train, cluster)
    layout = _defaults(fields)
    if layout is not None and _runnable_error(env, layout, gpus_from) is None:
        result = evaluate(model, train, cluster, layout, compare_with_search=compare_with_search)
        result.given = fields
        return result
    search, searched = _search(env, fields, zs)
    if search.best is None and allow_unfit and search.fam_leanest:  # none kept them within memory
        unbounded = copy.copy(env)
        unbounded.capacity = math.inf
        best = _constrained(unbounded, fields, zs, 0)
        if best is not None:
            result = evaluate(model, train, cluster, best.layout)
            result.reasons = chosen_reasons(env, fields, result.layout) + result.reasons
            result.given = fields
            return result
    if search.best is None:
        nearest, kept = _nearest(env, fields, zs)
        moved: dict[str, int] = {}
        if nearest is not None:
            nearest, moved = _move_closer(env, fields, kept, nearest, zs)
        raise LayoutRefused(_why_not(env, fields, nearest, gpus_from, search), fields, nearest, kept, moved)
    result = plan_from_search(env, search, searched, top_k)
    result.mode = "fill"  # searched over the layouts that keep every given field
    result.reasons = chosen_reasons(env, fields, result.layout) + result.reasons
    result.given = fields
    return result


def _search(env: Env, fields: Mapping[str, Any], zs: Sequence[int]) -> tuple[CandidateSearch, Sequence[int]]:
    """The search over every layout that keeps every field in `fields`, run."""
    if "zero_stage" in fields:
        zs = (fields["zero_stage"],)
    schedule = fields.get("schedule", "none")
    search = CandidateSearch(env, zs, DEFAULT_SCHEDULES if schedule == "none" else (schedule,), fixed=fields)
    search.run()
    return search, zs


def _constrained(env: Env, fields: Mapping[str, Any], zs: Sequence[int], top_k: int) -> Plan | None:
    """The fastest plan that keeps every field in `fields`, or None."""
    search, zs = _search(env, fields, zs)
    if search.best is None:
        return None
    return plan_from_search(env, search, zs, top_k)


def _too_big(env: Env, search: CandidateSearch) -> str | None:
    """The leanest layout of a search that kept every given field and found none that fits, and its
    memory; None when the search had no such layout."""
    if not search.fam_leanest:
        return None
    lean, desc = min(search.fam_leanest.values())
    return (f"{desc} needs {fmt_bytes(lean)} > {fmt_bytes(env.capacity)} per {env.gpu.name} GPU "
            "(the leanest layout that keeps them)")


def _nearest(env: Env, fields: dict[str, Any], zs: Sequence[int]) -> tuple[Plan | None, tuple[str, ...]]:
    """The fastest plan keeping the most given fields (dropping as few as possible), or None."""
    names = list(fields)
    tries = evaluated = 0
    for drop in range(1, len(names)):
        found: list[tuple[float, str, Plan, tuple[str, ...]]] = []
        for dropped in itertools.combinations(names, drop):
            if tries >= MAX_NEAREST_SEARCHES or evaluated > MAX_CANDIDATES:
                break
            tries += 1
            keep = {k: v for k, v in fields.items() if k not in dropped}
            try:
                p = _constrained(env, keep, zs, 0)
            except PlannerError:  # this subset's search space is too large: try the others
                evaluated += MAX_CANDIDATES // MAX_NEAREST_SEARCHES
                continue
            if p is not None:
                evaluated += p.candidates_evaluated
                found.append((p.step_time_s, describe(p.layout), p, tuple(keep)))
        if found:
            _, _, best, kept = min(found, key=lambda f: (f[0], f[1]))
            return best, kept
    try:
        return plan(env.model, env.train, env.cluster, zero_stages=zs, top_k=0), ()
    except PlannerError:
        return None, ()


def _closest(env: Env, name: str, value: int) -> list[int]:
    """Values of `name` other than `value` that may work, nearest to it first (by ratio; ties: the
    smaller): divisors of the GPU count for degrees, of the global batch for micro-batching, of the
    layer count for virtual stages."""
    totals = {"micro_batch_size": env.g, "num_microbatches": env.g, "virtual_stages": env.model.layers}
    total = totals.get(name, env.n)
    small = [d for d in range(1, math.isqrt(total) + 1) if total % d == 0]
    divisors = set(small) | {total // d for d in small}
    divisors.discard(value)
    return sorted(divisors, key=lambda c: (abs(math.log(c / value)), c))


def _move_closer(env: Env, fields: Mapping[str, Any], kept: Sequence[str], nearest: Plan,
                 zs: Sequence[int]) -> tuple[Plan, dict[str, int]]:
    """`nearest` with each numeric given field it does not keep moved, in the given order, to the
    value nearest the given one that still works with the kept fields (and the fields moved before
    it); (the plan, {field: value moved to}). At most MAX_MOVE_TRIES searches per field."""
    fixed = {k: fields[k] for k in kept}
    moved: dict[str, int] = {}
    for name, value in fields.items():
        if name in kept or name not in _MOVABLE:
            continue
        for candidate in _closest(env, name, value)[:MAX_MOVE_TRIES]:
            try:
                p = _constrained(env, {**fixed, **moved, name: candidate}, zs, 0)
            except PlannerError:  # this search space is too large: keep the nearest found so far
                break
            if p is not None:
                nearest, moved[name] = p, candidate
                break
    return nearest, moved


def _runnable_error(env: Env, layout: Layout, gpus_from: str) -> str | None:
    """Why the engine cannot run `layout` for this model, cluster and batch; None when it can."""
    try:
        check_layout_for_model(env.model, layout)
    except LayoutError as e:
        return str(e)
    if layout.world_size != env.n:
        return f"tp x cp x dp x pp = {layout.world_size} must equal {gpus_from} ({env.n})"
    try:
        validate_layout(env, layout)
    except PlannerError as e:
        return str(e)
    return None


def _why_not(env: Env, fields: dict[str, Any], nearest: Plan | None, gpus_from: str,
             search: CandidateSearch) -> str:
    """The first rule the given fields break: exact divisibility of their own products, the model's
    rules and the layout's with the given fields put into the nearest layout (so the rule named is
    one the given values break), memory. `search` is the failed search that kept every field."""
    merged = _merge(env, nearest.layout.to_dict() if nearest is not None else Layout().to_dict(), fields)
    try:
        layout: Layout | None = Layout(**merged)
        structure = None
    except LayoutError as e:
        layout, structure = None, str(e)
    # The model's rules on the given values themselves, then their own products: a rule the merge
    # broke with a degree it chose (pp made to restore the GPU count) is not the user's mistake.
    try:
        own: Layout | None = Layout(**fields)
    except (LayoutError, TypeError):
        own = None  # not a layout without other fields: the merged one below says why
    if own is not None:
        try:
            check_layout_for_model(env.model, own)
        except LayoutError as e:
            return str(e)
    degrees = {k: fields[k] for k in DEGREES if k in fields}
    product = math.prod(degrees.values())
    if degrees and (env.n % product or (len(degrees) == len(DEGREES) and product != env.n)):
        need = "equal" if len(degrees) == len(DEGREES) else "divide"
        return f"{' x '.join(degrees)} = {product} must {need} {gpus_from} ({env.n})"
    batch = {k: fields[k] for k in ("dp", "micro_batch_size", "num_microbatches") if k in fields}
    product = math.prod(batch.values())
    if batch and (env.g % product or (len(batch) == 3 and product != env.g)):
        need = "equal" if len(batch) == 3 else "divide"
        return f"{' x '.join(batch)} = {product} must {need} train.global_batch ({env.g})"
    if layout is not None:
        try:
            check_layout_for_model(env.model, layout)
        except LayoutError as e:
            return str(e)
    if layout is None:  # the nearest layout's other degrees break a rule: does memory rule them out?
        return _too_big(env, search) or str(structure)
    error = _runnable_error(env, layout, gpus_from)
    if error is not None:
        return error
    d = detail_for(env, layout)
    if not d.fits:
        return (
            f"{describe(layout)} needs {fmt_bytes(d.memory['total'])} > {fmt_bytes(env.capacity)} per "
            f"{env.gpu.name} GPU"
        )
    return f"no layout the planner can run keeps all of them (e.g. {describe(layout)} is outside its search)"


def _merge(env: Env, base: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` over `base`, with the fields that were not given adjusted to agree with them where
    they can: one free degree restores the GPU count, micro-batches the global batch."""
    merged = {**base, **fields}
    for k in ("dp", "pp", "tp", "cp"):
        others = math.prod(merged[o] for o in DEGREES if o != k)
        if k not in fields and env.n % others == 0:
            merged[k] = env.n // others
            break
    if "num_microbatches" not in fields:
        if "micro_batch_size" not in fields and env.g % (merged["dp"] * merged["micro_batch_size"]):
            merged["micro_batch_size"] = 1
        merged["num_microbatches"] = max(1, env.g // (merged["dp"] * merged["micro_batch_size"]))
    if "schedule" not in fields:
        keep = base["schedule"] if base["schedule"] != "none" else "1f1b"
        merged["schedule"] = "none" if merged["pp"] == 1 else keep
    if "virtual_stages" not in fields:
        multi = merged["schedule"] in MULTI_STAGE_SCHEDULES
        merged["virtual_stages"] = max(2, base["virtual_stages"]) if multi else 1
    if "sequence_parallel" not in fields and merged["tp"] == 1:
        merged["sequence_parallel"] = False
    if "ep" not in fields and (merged["dp"] * merged["cp"]) % merged["ep"]:
        merged["ep"] = 1
    if "dp_replicate" not in fields and (merged["dp"] % merged["dp_replicate"] or merged["zero_stage"] < 2
                                         or merged["cp"] > 1 or merged["ep"] > 1):
        merged["dp_replicate"] = 1
    return merged


def chosen_reasons(env: Env, fields: Mapping[str, Any], layout: Layout) -> list[str]:
    """One line for what was kept, then one per field the planner chose: its value and why."""
    out = [f"kept the given {given_text(fields)}; the planner chose the rest"]
    lay = layout.to_dict()
    for name in LAYOUT_FIELDS:
        if name not in fields:
            out.append(f"{name}: chose {_fmt(lay[name])} ({_why_chosen(env, fields, layout, name)})")
    return out


def _why_chosen(env: Env, fields: Mapping[str, Any], lay: Layout, name: str) -> str:
    def src(k: str) -> str:
        return f"{k}={getattr(lay, k)} {'given' if k in fields else 'chosen'}"

    if name in DEGREES:
        others = [k for k in DEGREES if k != name]
        text = f"{env.n} GPUs / ({' x '.join(src(k) for k in others)})"
        return text if all(k in fields for k in others) else f"{text}; {_FAST} split"
    if name == "ep":
        return f"{_FAST} expert split" if env.model.is_moe else "a dense model has no experts to split"
    if name == "schedule":
        if lay.pp == 1:
            return f"{src('pp')}: no pipeline"
        return f"{src('pp')}; {_FAST} of {', '.join(DEFAULT_SCHEDULES)}"
    if name == "num_microbatches":
        return f"global batch {env.g} / ({src('dp')} x {src('micro_batch_size')})"
    if name == "virtual_stages":
        if lay.schedule not in MULTI_STAGE_SCHEDULES:
            return f"schedule {lay.schedule} runs one stage per rank"
        return f"{_FAST} interleaving depth for {lay.schedule}"
    if name == "sequence_parallel" and lay.tp == 1:
        return f"{src('tp')}: nothing to split"
    if name == "dp_replicate":
        if lay.zero_stage < 2:
            return f"{src('zero_stage')}: HSDP replicates ZeRO-2/3 shards only"
        if lay.dp_replicate > 1:
            span = lay.tp * lay.dp_shard
            where = f"one {env.gpn}-GPU node" if span == env.gpn else f"{span} GPUs"
            return (f"{_FAST}: FSDP shards within groups of dp_shard={lay.dp_shard} ranks ({where} each), "
                    f"the {lay.dp_replicate} groups all-reduce their gradient shards once per step")
        r = hsdp_replicas(env.gpn, lay.tp, lay.cp, lay.dp, lay.ep)
        if r > 1:
            return f"one FSDP shard group over all dp ranks: {_FAST} that fits, ahead of dp_replicate={r}"
        return ("one FSDP shard group over all dp ranks; HSDP is tried only where the dp group spans nodes "
                "(cp = ep = 1, shard group = one node)")
    return f"{_FAST} that fits; ties go to less traffic, then the lower ZeRO stage"
