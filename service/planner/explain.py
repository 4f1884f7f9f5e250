"""The planner's explanations: why the chosen layout wins, how each alternative compares, and what
to change when nothing fits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.planner.candidates import RECOMPUTE, CandidateSearch, detail_for, hsdp_replicas, smallest_fitting
from service.planner.costmodel import Env
from service.planner.errors import PlannerError
from service.planner.result import Detail, Plan, describe, fmt_bytes, why_slower
from service.planner.specs import MAX_GPUS
from training.config.layout import LayoutError

MAX_REASONS_LISTED = 8


def too_big_message(env: Env, search: CandidateSearch, zero_stages: Sequence[int],
                    schedules: Sequence[str]) -> str:
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
        smallest = smallest_fitting(env, zero_stages, schedules)
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


def alternative(env: Env, d: Detail, best: Detail) -> dict[str, Any]:
    slower = d.step_time_s / best.step_time_s - 1.0
    return {
        "layout": d.layout.to_dict(),
        "describe": describe(d.layout),
        "step_time_s": d.step_time_s,
        "mfu": env.flops_per_step / (d.step_time_s * env.eff.peak * env.n),
        "memory_total_bytes": int(round(d.memory["total"])),
        "slower_by": slower,
        "why": f"{slower:.1%} slower: {why_slower(d, best)}",
    }


def hsdp_note(d: Detail) -> str | None:
    """What HSDP (dp_replicate > 1) shards and sends, for the reasons; None without it."""
    lay = d.layout
    if lay.dp_replicate <= 1:
        return None
    return (
        f"dp_replicate={lay.dp_replicate} (HSDP): ZeRO-{lay.zero_stage} shards over dp_shard={lay.dp_shard} "
        f"ranks on the {d.tiers['dp']} tier, so each holds 1/{lay.dp_shard} of the state; the "
        f"{lay.dp_replicate} replicas all-reduce their gradient shards on the "
        f"{d.tiers['dp_replicate']} tier, {fmt_bytes(d.comm['dp_replicate'])} per GPU per step"
    )


def _variant_note(env: Env, base: Detail, label: str, **changes: Any) -> str | None:
    try:  # a variant the Layout itself refuses (e.g. zero=1 with dp_replicate > 1) gets no note
        d = detail_for(env, base.layout.with_(**changes))
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


def _hsdp_choice(env: Env, d: Detail) -> list[str]:
    """Why HSDP was (not) chosen: the same layout with flat ZeRO-2/3 over all dp ranks, or with the
    one HSDP split the search tries (shard group = one node; candidates.hsdp_replicas)."""
    lay = d.layout
    if lay.dp_replicate > 1:
        label = f"dp_replicate=1 (ZeRO-{lay.zero_stage} sharded over all dp={lay.dp} ranks)"
        note = _variant_note(env, d, label, dp_replicate=1)
        return [note] if note else []
    r = hsdp_replicas(env.gpn, lay.tp, lay.cp, lay.dp, lay.ep)
    if lay.zero_stage < 2 or r <= 1:
        return []
    note = _variant_note(env, d, f"dp_replicate={r} (HSDP, one shard group per {env.gpn}-GPU node)",
                         dp_replicate=r)
    return [note] if note else []


def explain(env: Env, d: Detail, p: Plan, search: CandidateSearch, zs: Sequence[int]) -> list[str]:
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
        group = f"dp={lay.dp}" + (f" (FSDP over dp_shard={lay.dp_shard})" if lay.dp_replicate > 1 else "")
        out.append(
            f"{group} gradient traffic crosses the {d.tiers['dp']} tier, "
            f"{d.time_s['dp_exposed'] * 1e3:.3g} ms of it exposed"
        )
    hsdp = hsdp_note(d)
    if hsdp:
        out.append(hsdp)
    out.extend(_hsdp_choice(env, d))
    for z in zs:
        if z != lay.zero_stage:
            note = _variant_note(env, d, f"zero={z}", zero_stage=z)
            if note:
                out.append(note)
    for rc in RECOMPUTE:
        if rc != lay.recompute:
            note = _variant_note(env, d, f"recompute={rc}", recompute=rc)
            if note:
                out.append(note)
    if lay.tp > 1:
        note = _variant_note(
            env,
            d,
            f"sequence_parallel={'off' if lay.sequence_parallel else 'on'}",
            sequence_parallel=not lay.sequence_parallel,
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

