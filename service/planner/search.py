"""The search over layouts (`plan`) and the prediction for one fixed layout (`evaluate`).

Enumeration, outermost first: tp (divides the node and the heads), cp (divides the sequence, stays in
a rack), pp (any degree up to the layer count; uneven splits give the busiest rank ceil(L/(p v))
layers), dp = N / (tp cp pp) (divides the global batch), ep (MoE only), micro-batch size (m follows),
sequence parallel, recomputation, schedule (and interleaving depth v), ZeRO stage. Each level computes
only what it adds (costmodel.py), and a candidate whose pipeline time alone is already slower than its
family's best is not finished. The fastest candidate wins; exact ties go to less traffic, then the
lower ZeRO stage, then less memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from service.planner.costmodel import Combo, Env, Family, Micro, Stage, combine, finish
from service.planner.errors import PlannerError
from service.planner.formulas import V_SHAPED
from service.planner.result import Detail, Plan, build_detail, describe, fmt_bytes, why_slower
from service.planner.specs import MAX_GPUS, ClusterSpec, TrainSpec
from training.config.layout import MULTI_STAGE_SCHEDULES, SCHEDULES, Layout, LayoutError
from training.config.spec import ModelSpec

log = logging.getLogger(__name__)

DEFAULT_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
INTERLEAVE_DEPTHS: tuple[int, ...] = (2, 3, 4, 6, 8)  # v tried by the search for interleaved schedules
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MAX_MICRO_BATCH = 1024
# Context parallel is searched only while each rank keeps this many tokens: shorter ring blocks cannot
# hide the K/V exchange and run attention kernels far below peak (Llama 3 uses CP only for long context).
MIN_CP_TOKENS = 2048
MAX_REASONS_LISTED = 8
# Candidates one request may evaluate (a 16k-GPU 405B search needs ~10^4); protects the API from
# pathological inputs (a million GPUs, thousands of layers, huge batches).
MAX_CANDIDATES = 2_000_000

# A candidate: (step_s, zero_stage, mem_bytes, stage, micro, combo)
Candidate = tuple[float, int, float, Stage, Micro, Combo]


def _divisors(n: int) -> list[int]:
    small, large = [], []
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def _schedule_options(pp: int, m: int, layers: int, schedules: Sequence[str]) -> list[tuple[str, int]]:
    """(schedule, v) pairs that can run `m` micro-batches on `pp` ranks (the torch schedules' rules)."""
    if pp == 1:
        return [("none", 1)]
    out: list[tuple[str, int]] = []
    for sch in schedules:
        if sch == "gpipe":
            out.append((sch, 1))
        elif sch == "1f1b" and m >= pp:
            out.append((sch, 1))
        elif sch in ("interleaved_1f1b", "interleaved_zero_bubble") and m % pp == 0:
            out.extend((sch, v) for v in INTERLEAVE_DEPTHS if pp * v <= layers)
        elif sch in V_SHAPED and m >= 2 * pp and 2 * pp <= layers:
            out.append((sch, 2))
    return out


def _layout(stage: Stage, micro: Micro, combo: Combo, z: int) -> Layout:
    f = stage.fam
    return Layout(
        tp=f.tp,
        pp=f.pp,
        dp=f.dp,
        cp=f.cp,
        ep=f.ep,
        zero_stage=z,
        micro_batch_size=micro.mbs,
        num_microbatches=combo.m,
        schedule=combo.schedule,
        sequence_parallel=micro.sp,
        recompute=micro.recompute,
        virtual_stages=stage.v,
    )


def _comm_total(c: Candidate) -> float:
    stage, micro, combo, z = c[3], c[4], c[5], c[1]
    m = combo.m
    return (
        m * stage.layers * (micro.tp_bytes + micro.cp_bytes + micro.ep_bytes)
        + m * stage.v * micro.p2p_bytes
        + stage.dp_bytes_once[z]
        + m * stage.dp_bytes_per_mb[z]
    )


def _better(a: Candidate, b: Candidate | None) -> bool:
    """Is `a` preferred to `b`: faster; on an exact tie less traffic, lower ZeRO stage, less memory."""
    if b is None or a[0] < b[0]:
        return True
    if a[0] > b[0]:
        return False
    ka = (_comm_total(a), a[1], a[2], describe(_layout(a[3], a[4], a[5], a[1])))
    kb = (_comm_total(b), b[1], b[2], describe(_layout(b[3], b[4], b[5], b[1])))
    return ka < kb


class _Search:
    def __init__(
        self,
        env: Env,
        zero_stages: Sequence[int],
        schedules: Sequence[str],
        first_fit: bool = False,
        budget: int = MAX_CANDIDATES,
    ):
        self.env = env
        self.zs = tuple(zero_stages)
        self.schedules = tuple(schedules)
        self.first_fit = first_fit
        self.budget = budget
        self.evaluated = 0
        self.families = 0  # structurally valid families
        self.rejected: list[dict[str, str]] = []
        self._seen: set[tuple[str, str]] = set()
        self.fam_best: dict[tuple[int, ...], Candidate] = {}
        self.fam_leanest: dict[tuple[int, ...], tuple[float, str]] = {}
        self.best: Candidate | None = None

    def _reject(self, family: str, reason: str) -> None:
        if (family, reason) not in self._seen:
            self._seen.add((family, reason))
            self.rejected.append({"family": family, "reason": reason})

    def tp_options(self) -> list[int]:
        env, m = self.env, self.env.model
        out = []
        crossed = False
        for t in _divisors(env.n):
            if t > m.heads:
                break
            bad = [f"{v} {what}" for v, what in ((m.heads, "heads"), (m.n_kv_heads, "KV heads"),
                   (m.ffn_dim, "FFN columns"), (m.vocab, "vocabulary entries")) if v % t]
            if bad:
                self._reject(f"tp={t}", f"tp={t} does not divide the {bad[0]}")
            elif t > env.gpn or env.gpn % t:
                if not crossed:
                    self._reject(f"tp={t}", f"tp={t} crosses the {env.gpn}-GPU node")
                    crossed = True
            else:
                out.append(t)
        return out

    def run(self) -> None:
        env, model = self.env, self.env.model
        for tp in self.tp_options():
            if model.is_moe and tp > 1:
                # The engine splits experts with ep, not tp (training.config.validate.check_layout_for_model).
                self._reject(f"tp={tp}", f"tp={tp} with an MoE model: experts are split with ep, not tp")
                continue
            for cp in _divisors(env.n // tp):
                if env.s % cp or (cp > 1 and env.s % (2 * cp)):
                    continue  # each CP rank holds two chunks for causal load balance
                if cp > 1 and env.s // cp < MIN_CP_TOKENS:
                    break
                span = tp * cp
                if env.n > env.rack and (span > env.rack or env.rack % span):
                    self._reject(f"cp={cp}", f"cp={cp} with tp={tp} spans more than a {env.rack}-GPU rack")
                    continue
                too_deep = False
                for pp in _divisors(env.n // span):
                    if pp > model.layers:
                        if not too_deep:
                            self._reject(f"pp={pp}", f"pp={pp} exceeds the {model.layers} layers")
                            too_deep = True
                        continue
                    if pp > 1 and model.tied_embeddings:
                        self._reject(f"pp={pp}", "tied embeddings need embedding and head on one stage")
                        continue
                    dp = env.n // (span * pp)
                    name = f"tp={tp},pp={pp},dp={dp}" + (f",cp={cp}" if cp > 1 else "")
                    if dp > env.g:
                        self._reject(
                            name, f"dp={dp} > global batch {env.g} (at least one sequence per replica)"
                        )
                        continue
                    if env.g % dp:
                        self._reject(name, f"dp={dp} does not divide global batch {env.g}")
                        continue
                    eps = _divisors(math.gcd(model.num_experts, dp * cp)) if model.is_moe else [1]
                    for ep in eps:
                        self.families += 1
                        if self._family(
                            Family(env, tp, cp, pp, dp, ep), name + (f",ep={ep}" if ep > 1 else "")
                        ):
                            return

    def _family(self, fam: Family, name: str) -> bool:
        """Search one family; True when first_fit found a fit."""
        env, key = self.env, fam.key()
        cap, zs = env.capacity, self.zs
        if fam.ep > 1:
            # FSDP of expert-parallel weights is not implemented; ZeRO-1 shards their optimizer state.
            zs = tuple(z for z in zs if z <= 1)
            if not zs:
                self._reject(name, "ep > 1 needs zero stage 0 or 1")
                return False
        b_local = env.g // fam.dp
        stages: dict[tuple[int, bool], Stage] = {}
        best: Candidate | None = None
        lean = math.inf
        lean_desc = ""
        sps = (True, False) if fam.tp > 1 else (False,)
        for mbs in _divisors(b_local):
            if mbs > MAX_MICRO_BATCH:
                break
            m = b_local // mbs
            options = _schedule_options(fam.pp, m, env.model.layers, self.schedules)
            if not options:
                continue
            for sp in sps:
                if self.evaluated > self.budget:
                    raise PlannerError(
                        f"search space too large ({self.evaluated} candidates evaluated): narrow it with "
                        "fewer zero_stages, fewer GPUs or a smaller global batch, or evaluate a given layout"
                    )
                for rc in RECOMPUTE:
                    micro = Micro(fam, mbs, sp, rc)
                    for schedule, v in options:
                        skey = (v, schedule in V_SHAPED)
                        stage = stages.get(skey)
                        if stage is None:
                            stage = stages[skey] = Stage(fam, v, skey[1])
                        combo = combine(stage, micro, schedule, m)
                        if best is not None and combo.core > best[0]:
                            continue  # cannot beat this family's best: the rest of a step only adds time
                        for z in zs:
                            self.evaluated += 1
                            step, mem = finish(stage, combo, z)
                            if mem > cap:
                                if mem < lean:
                                    lean = mem
                                    lean_desc = describe(_layout(stage, micro, combo, z))
                                continue
                            cand = (step, z, mem, stage, micro, combo)
                            if self.first_fit:
                                self.best = cand
                                return True
                            if _better(cand, best):
                                best = cand
        if best is None:
            if lean < math.inf:
                self._reject(
                    name,
                    f"needs {fmt_bytes(lean)} > {fmt_bytes(cap)} per GPU even at its leanest ({lean_desc})",
                )
                self.fam_leanest[key] = (lean, lean_desc)
            return False
        self.fam_best[key] = best
        if _better(best, self.best):
            self.best = best
        return False


def _check(value: Iterable[Any], allowed: Iterable[Any], name: str) -> tuple[Any, ...]:
    vals = tuple(value)
    allowed = tuple(allowed)
    if not vals or any(v not in allowed for v in vals) or len(set(vals)) != len(vals):
        raise PlannerError(
            f"{name} must be a non-empty list of distinct values from {list(allowed)}, got {list(vals)}"
        )
    return vals


def _too_big_message(env: Env, search: _Search, zero_stages: Sequence[int], schedules: Sequence[str]) -> str:
    m, c = env.model, env.cluster
    head = (
        f"model {m.name!r} with global batch {env.g} and seq_len {env.s} fits no layout on {env.n} "
        f"{env.gpu.name} GPUs"
    )
    if not search.fam_leanest:
        if search.families == 0:
            return (
                f"{head}: no tp x cp x pp x dp split of {env.n} GPUs has dp dividing global batch {env.g}; "
                f"use a global batch that is a multiple of the data-parallel size or fewer GPUs"
            )
        return f"{head}: no schedule can run the batch (try more micro-batches)"
    lean, desc = min(search.fam_leanest.values())
    msg = f"{head}: the leanest layout ({desc}) needs {fmt_bytes(lean)} > {fmt_bytes(env.capacity)} per GPU"
    try:
        smallest = _smallest_fitting(env, zero_stages, schedules)
    except PlannerError:  # the bracket got too expensive to search
        smallest = None
    if smallest is None:
        return (
            msg + f"; no {env.gpu.name} cluster of up to {MAX_GPUS} GPUs was found that fits it at this "
            "global batch"
        )
    return (
        msg
        + f"; the smallest {env.gpu.name} cluster that fits is {smallest} GPUs "
        + (f"({smallest // c.node_size} nodes)" if smallest > c.node_size else "(one node)")
    )


def _fits(env: Env, zero_stages: Sequence[int], schedules: Sequence[str], budget: int) -> bool:
    s = _Search(env, zero_stages, schedules, first_fit=True, budget=budget)
    s.run()
    return s.best is not None


def _smallest_fitting(env: Env, zero_stages: Sequence[int], schedules: Sequence[str]) -> int | None:
    """Smallest whole-node cluster that fits: doubling to bracket it, then a coarse scan of the bracket."""
    c, gpn = env.cluster, env.cluster.node_size

    def fits(n: int) -> bool:
        return _fits(Env(env.model, env.train, c.with_gpus(n)), zero_stages, schedules, MAX_CANDIDATES // 20)

    if env.n < gpn:  # a partial node first: the rest of the node, one GPU at a time
        for n in range(env.n + 1, gpn + 1):
            if fits(n):
                return n
        prev, n = gpn, 2 * gpn
    else:
        prev, n = env.n, (env.n // gpn + 1) * gpn
    hi = None
    while n <= MAX_GPUS:
        if fits(n):
            hi = n
            break
        prev, n = n, n * 2
    if hi is None:
        return None
    first = (prev // gpn + 1) * gpn
    step = max(gpn, (hi - first) // 16 // gpn * gpn)
    for cand in range(first, hi, step):
        if fits(cand):
            return cand
    return hi


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
    search = _Search(env, zs, schs)
    search.run()
    if search.best is None:
        raise PlannerError(_too_big_message(env, search, zs, schs))
    step, z, _, stage, micro, combo = search.best
    detail = build_detail(stage, micro, combo, z, _layout(stage, micro, combo, z))
    result = Plan.from_detail(detail, mode="search", env=env)
    result.candidates_evaluated = search.evaluated
    result.rejected = search.rejected
    others = [c for k, c in search.fam_best.items() if k != stage.fam.key()]
    for c in sorted(others, key=lambda c: c[0])[:top_k]:
        d = build_detail(c[3], c[4], c[5], c[1], _layout(c[3], c[4], c[5], c[1]))
        result.alternatives.append(_alternative(env, d, detail))
    result.reasons = _explain(env, detail, result, search, zs)
    log.debug(
        "planned %s on %d %s: %s in %d candidates",
        model.name,
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


def _alternative(env: Env, d: Detail, best: Detail) -> dict[str, Any]:
    slower = d.step_time_s / best.step_time_s - 1.0
    return {
        "layout": d.layout.to_dict(),
        "describe": describe(d.layout),
        "step_time_s": d.step_time_s,
        "mfu": env.flops_per_step / (d.step_time_s * env.gpu.peak_flops * env.n),
        "memory_total_bytes": int(round(d.memory["total"])),
        "slower_by": slower,
        "why": f"{slower:.1%} slower: {why_slower(d, best)}",
    }


def _variant_note(env: Env, base: Detail, label: str, layout: Layout) -> str | None:
    try:
        d = _detail_for(env, layout)
    except (PlannerError, LayoutError):
        return None
    if not d.fits:
        return f"{label} needs {fmt_bytes(d.memory['total'])} > {fmt_bytes(env.capacity)}"
    if d.step_time_s > base.step_time_s:
        return f"{label}: {d.step_time_s / base.step_time_s - 1:.1%} slower ({why_slower(d, base)})"
    extra = d.memory["total"] - base.memory["total"]
    if d.step_time_s == base.step_time_s:
        if extra > 0:
            return f"{label}: same step time, {fmt_bytes(extra)} more memory"
        return f"{label}: same step time, lost the tie-break (less traffic, then lower ZeRO stage)"
    return None


def _explain(env: Env, d: Detail, p: Plan, search: _Search, zs: Sequence[int]) -> list[str]:
    lay = d.layout
    out = [
        f"chosen {describe(lay)}: {p.step_time_s:.4g} s/step, MFU {p.mfu:.1%}, "
        f"{fmt_bytes(d.memory['total'])} of {fmt_bytes(env.capacity)} per GPU; "
        f"best of {search.evaluated} candidates "
        f"in {search.families} tp x cp x pp x dp families"
    ]
    if lay.tp > 1:
        out.append(f"tp={lay.tp} all-reduces run on the {d.tiers['tp']} tier (inside the {env.gpn}-GPU node)")
    if lay.pp > 1:
        out.append(
            f"pp={lay.pp} sends b*s*h per micro-batch over the {d.tiers['pp']} tier; bubble "
            f"{d.bubble:.1%} with m={lay.num_microbatches}"
            + (f", v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        )
    if lay.cp > 1:
        out.append(
            f"cp={lay.cp} splits each {env.s}-token sequence ({env.s // lay.cp} tokens per rank): "
            f"ring attention on the {d.tiers['cp']} tier, {fmt_bytes(d.comm['cp'])} per GPU per step, "
            f"{d.time_s['cp'] * 1e3:.3g} ms not hidden behind attention"
        )
    if lay.ep > 1:
        out.append(
            f"ep={lay.ep} splits the {env.model.num_experts} experts "
            f"({env.model.num_experts // lay.ep} per GPU): all-to-all on the {d.tiers['ep']} tier, "
            f"{fmt_bytes(d.comm['ep'])} per GPU per step, {d.time_s['ep'] * 1e3:.3g} ms exposed"
        )
    if lay.dp * lay.cp > 1:
        out.append(
            f"dp={lay.dp} gradient traffic crosses the {d.tiers['dp']} tier, "
            f"{d.time_s['dp_exposed'] * 1e3:.3g} ms of it exposed"
        )
    for z in zs:
        if z != lay.zero_stage:
            note = _variant_note(env, d, f"zero={z}", lay.with_(zero_stage=z))
            if note:
                out.append(note)
    for rc in RECOMPUTE:
        if rc != lay.recompute:
            note = _variant_note(env, d, f"recompute={rc}", lay.with_(recompute=rc))
            if note:
                out.append(note)
    if lay.tp > 1:
        note = _variant_note(
            env,
            d,
            f"sequence_parallel={'off' if lay.sequence_parallel else 'on'}",
            lay.with_(sequence_parallel=not lay.sequence_parallel),
        )
        if note:
            out.append(note)
    for alt in p.alternatives[:3]:
        out.append(f"alternative {alt['describe']}: {alt['why']}")
    shown = search.rejected[:MAX_REASONS_LISTED]
    out.extend(f"rejected {r['family']}: {r['reason']}" for r in shown)
    if len(search.rejected) > len(shown):
        out.append(f"... and {len(search.rejected) - len(shown)} more rejected families (see rejected[])")
    return out


def _validate_layout(env: Env, layout: Layout) -> None:
    m = env.model
    if layout.world_size != env.n:
        raise PlannerError(
            f"layout: tp x cp x dp x pp = {layout.world_size} must equal cluster.num_gpus ({env.n})"
        )
    if layout.global_batch != env.g:
        raise PlannerError(
            f"layout: dp x micro_batch_size x num_microbatches = {layout.global_batch} must equal "
            f"train.global_batch ({env.g})"
        )
    if m.heads % layout.tp or m.n_kv_heads % layout.tp:
        raise PlannerError(
            f"layout.tp ({layout.tp}) must divide model.heads ({m.heads}) and kv_heads ({m.n_kv_heads})"
        )
    if env.s % layout.cp:
        raise PlannerError(f"layout.cp ({layout.cp}) must divide train.seq_len ({env.s})")
    if layout.num_stages > m.layers:
        raise PlannerError(
            f"layout: pp x virtual_stages = {layout.num_stages} must be <= model.layers ({m.layers})"
        )
    if not m.is_moe and layout.ep != 1:
        raise PlannerError(f"layout.ep must be 1 for a dense model, got {layout.ep}")
    if m.is_moe and m.num_experts % layout.ep:
        raise PlannerError(f"layout.ep ({layout.ep}) must divide model.num_experts ({m.num_experts})")


def _detail_for(env: Env, layout: Layout) -> Detail:
    _validate_layout(env, layout)
    fam = Family(env, layout.tp, layout.cp, layout.pp, layout.dp, layout.ep)
    stage = Stage(fam, layout.virtual_stages, layout.schedule in V_SHAPED)
    micro = Micro(fam, layout.micro_batch_size, layout.sequence_parallel, layout.recompute)
    combo = combine(stage, micro, layout.schedule, layout.num_microbatches)
    return build_detail(stage, micro, combo, layout.zero_stage, layout)


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
    d = _detail_for(env, layout)
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
