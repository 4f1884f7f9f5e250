"""Candidate enumeration and scoring for the planner: the layouts a cluster admits, outermost first
(tp, cp, pp, dp, ep, micro-batch size, sequence parallel, recomputation, schedule, ZeRO stage), the
cost of each from costmodel.py, the order between two candidates, and the smallest cluster that
fits a model. `detail_for` scores one fixed layout."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from service.planner.costmodel import Combo, Env, Family, Micro, Stage, combine, finish
from service.planner.errors import PlannerError
from service.planner.formulas import V_SHAPED
from service.planner.result import Detail, build_detail, describe, fmt_bytes
from service.planner.specs import MAX_GPUS
from training.config.layout import Layout

DEFAULT_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
INTERLEAVE_DEPTHS: tuple[int, ...] = (2, 3, 4, 6, 8)  # v tried by the search for interleaved schedules
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MAX_MICRO_BATCH = 1024
# Context parallel is searched only while each rank keeps this many tokens: shorter ring blocks cannot
# hide the K/V exchange and run attention kernels far below peak (Llama 3 uses CP only for long context).
MIN_CP_TOKENS = 2048
# Candidates one request may evaluate (a 16k-GPU 405B search needs ~10^4); protects the API from
# pathological inputs (a million GPUs, thousands of layers, huge batches).
MAX_CANDIDATES = 2_000_000

# A candidate: (step_s, zero_stage, mem_bytes, stage, micro, combo)
Candidate = tuple[float, int, float, Stage, Micro, Combo]


def divisors(n: int) -> list[int]:
    small, large = [], []
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            small.append(i)
            if i != n // i:
                large.append(n // i)
    return small + large[::-1]


def hsdp_replicas(gpn: int, tp: int, cp: int, dp: int, ep: int) -> int:
    """The one HSDP split the search tries for a family: r = dp / dp_shard with the shard group
    (tp x dp_shard consecutive ranks) filling exactly one `gpn`-GPU node, so FSDP's per-micro-batch
    gathers and reduce-scatters stay inside it and only the once-per-step all-reduce crosses nodes.
    1 (no HSDP) unless cp = ep = 1, the dp group spans more than a node, tp divides the node,
    dp_shard >= 2 (1 is plain replication: ZeRO-0's job) and dp_shard divides dp."""
    if cp != 1 or ep != 1 or tp * dp <= gpn or gpn % tp:
        return 1
    shard = gpn // tp
    return dp // shard if shard >= 2 and dp % shard == 0 else 1


def schedule_options(pp: int, m: int, layers: int, schedules: Sequence[str],
                     depths: Sequence[int] = INTERLEAVE_DEPTHS) -> list[tuple[str, int]]:
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
            out.extend((sch, v) for v in depths if v >= 2 and pp * v <= layers)
        elif sch in V_SHAPED and m >= 2 * pp and 2 * pp <= layers:
            out.append((sch, 2))
    return out


def candidate_layout(stage: Stage, micro: Micro, combo: Combo, z: int) -> Layout:
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
        dp_replicate=f.r,
    )


def comm_total(c: Candidate) -> float:
    stage, micro, combo, z = c[3], c[4], c[5], c[1]
    m = combo.m
    return (
        m * stage.layers * (micro.tp_bytes + micro.cp_bytes + micro.ep_bytes)
        + m * stage.v * micro.p2p_bytes
        + stage.dp_bytes_once[z]
        + stage.hsdp_bytes[z]
        + m * stage.dp_bytes_per_mb[z]
    )


def better(a: Candidate, b: Candidate | None) -> bool:
    """Is `a` preferred to `b`: faster; on an exact tie no HSDP (the simpler layout), less traffic,
    lower ZeRO stage, less memory."""
    if b is None or a[0] < b[0]:
        return True
    if a[0] > b[0]:
        return False
    ka = (a[3].fam.r, comm_total(a), a[1], a[2], describe(candidate_layout(a[3], a[4], a[5], a[1])))
    kb = (b[3].fam.r, comm_total(b), b[1], b[2], describe(candidate_layout(b[3], b[4], b[5], b[1])))
    return ka < kb


class CandidateSearch:
    """Every layout the cluster admits, outermost first; `fixed` (Layout field -> value) keeps only
    the layouts with those values (a partial layout, service.planner.fill). A fixed degree is taken
    even where the search would not choose it for speed (tp across nodes, cp below MIN_CP_TOKENS or
    across racks), as long as the engine can run it."""

    def __init__(
        self,
        env: Env,
        zero_stages: Sequence[int],
        schedules: Sequence[str],
        first_fit: bool = False,
        budget: int = MAX_CANDIDATES,
        fixed: Mapping[str, Any] | None = None,
    ):
        self.env = env
        self.fixed: dict[str, Any] = dict(fixed or {})
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

    def _allowed(self, name: str, value: Any) -> bool:
        return name not in self.fixed or self.fixed[name] == value

    def tp_options(self) -> list[int]:
        env, m = self.env, self.env.model
        out = []
        crossed = False
        for t in divisors(env.n):
            if t > m.heads:
                break
            if not self._allowed("tp", t):
                continue
            bad = [f"{v} {what}" for v, what in ((m.heads, "heads"), (m.n_kv_heads, "KV heads"),
                   (m.ffn_dim, "FFN columns"), (m.vocab, "vocabulary entries")) if v % t]
            if bad:
                self._reject(f"tp={t}", f"tp={t} does not divide the {bad[0]}")
            elif (t > env.gpn or env.gpn % t) and "tp" not in self.fixed:
                if not crossed:
                    self._reject(f"tp={t}", f"tp={t} crosses the {env.gpn}-GPU node")
                    crossed = True
            else:
                out.append(t)
        return out

    def run(self) -> None:
        env, model = self.env, self.env.model
        # A given dp_replicate is the only one tried; otherwise each family also tries one HSDP split
        # (hsdp_replicas: shard group = one node) beside r = 1, on the same micro-batches (_family).
        r = self.fixed.get("dp_replicate", 1)
        search_r = "dp_replicate" not in self.fixed
        for tp in self.tp_options():
            if model.is_moe and tp > 1:
                # The engine splits experts with ep, not tp (training.config.validate.check_layout_for_model).
                self._reject(f"tp={tp}", f"tp={tp} with an MoE model: experts are split with ep, not tp")
                continue
            given = "tp" in self.fixed or "cp" in self.fixed  # taken even where slow
            for cp in divisors(env.n // tp):
                if env.s % cp or (cp > 1 and env.s % (2 * cp)) or not self._allowed("cp", cp):
                    continue  # each CP rank holds two chunks for causal load balance
                if cp > 1 and env.s // cp < MIN_CP_TOKENS and "cp" not in self.fixed:
                    break
                if cp > 1 and r > 1:
                    self._reject(f"cp={cp}", f"dp_replicate={r} needs cp = 1 (HSDP shards over DP only)")
                    continue
                span = tp * cp
                if not given and env.n > env.rack and (span > env.rack or env.rack % span):
                    self._reject(f"cp={cp}", f"cp={cp} with tp={tp} spans more than a {env.rack}-GPU rack")
                    continue
                too_deep = False
                for pp in divisors(env.n // span):
                    if not self._allowed("pp", pp) or not self._allowed("dp", env.n // (span * pp)):
                        continue
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
                    if dp % r:
                        self._reject(name, f"dp_replicate={r} does not divide dp={dp}")
                        continue
                    eps = divisors(math.gcd(model.num_experts, dp * cp)) if model.is_moe and r == 1 else [1]
                    for ep in (e for e in eps if self._allowed("ep", e)):
                        self.families += 1
                        label = name + (f",ep={ep}" if ep > 1 else "")
                        label += f",dp_replicate={r}" if r > 1 else ""
                        hr = hsdp_replicas(env.gpn, tp, cp, dp, ep) if search_r else 1
                        if self._family(Family(env, tp, cp, pp, dp, ep, r), label, hr):
                            return

    def _zero_stages(self, fam: Family, name: str) -> tuple[int, ...]:
        """The ZeRO stages this family may use (rejecting it when none)."""
        zs = tuple(z for z in self.zs if self._allowed("zero_stage", z))
        if fam.ep > 1:
            # FSDP of expert-parallel weights is not implemented; ZeRO-1 shards their optimizer state.
            zs = tuple(z for z in zs if z <= 1)
            if not zs:
                self._reject(name, "ep > 1 needs zero stage 0 or 1")
        if fam.r > 1:  # HSDP replicates FSDP2's shards (training.config.layout)
            zs = tuple(z for z in zs if z >= 2)
            if not zs:
                self._reject(name, f"dp_replicate={fam.r} needs zero stage 2 or 3")
        return zs

    def _family(self, fam: Family, name: str, hsdp_r: int = 1) -> bool:
        """Search one family; True when first_fit found a fit. With `hsdp_r` > 1 every micro-batch
        shape and schedule is also finished as HSDP with that dp_replicate at ZeRO-2/3 (the pipeline
        part, Micro and combine, does not depend on r: only the Stage's state and DP terms do); the
        family's best is the better of the two."""
        env, key = self.env, fam.key()
        cap, zs = env.capacity, self._zero_stages(fam, name)
        if not zs:
            return False
        hzs = tuple(z for z in zs if z >= 2) if hsdp_r > 1 else ()
        hfam = Family(env, fam.tp, fam.cp, fam.pp, fam.dp, fam.ep, hsdp_r) if hzs else None
        b_local = env.g // fam.dp
        stages: dict[tuple[int, bool], tuple[tuple[Stage, tuple[int, ...]], ...]] = {}
        best: Candidate | None = None
        lean = math.inf
        lean_desc = ""
        # Sequence parallel splits each rank's sequence over the TP group (the engine's rule).
        sp_ok = fam.tp > 1 and (env.s // fam.cp) % fam.tp == 0
        sps = tuple(sp for sp in ((True, False) if sp_ok else (False,))
                    if self._allowed("sequence_parallel", sp))
        rcs = tuple(rc for rc in RECOMPUTE if self._allowed("recompute", rc))
        depths = (self.fixed["virtual_stages"],) if "virtual_stages" in self.fixed else INTERLEAVE_DEPTHS
        for mbs in divisors(b_local):
            if mbs > MAX_MICRO_BATCH and "micro_batch_size" not in self.fixed:
                break
            m = b_local // mbs
            if not self._allowed("micro_batch_size", mbs) or not self._allowed("num_microbatches", m):
                continue
            options = [
                (sch, v)
                for sch, v in schedule_options(fam.pp, m, env.model.layers, self.schedules, depths)
                if self._allowed("schedule", sch) and self._allowed("virtual_stages", v)
            ]
            if not options:
                continue
            for sp in sps:
                if self.evaluated > self.budget:
                    raise PlannerError(
                        f"search space too large ({self.evaluated} candidates evaluated): narrow it with "
                        "fewer zero_stages, fewer GPUs or a smaller global batch, or evaluate a given layout"
                    )
                for rc in rcs:
                    micro = Micro(fam, mbs, sp, rc)
                    for schedule, v in options:
                        skey = (v, schedule in V_SHAPED)
                        both = stages.get(skey)
                        if both is None:  # (stage, its ZeRO stages): r = 1, then the HSDP split
                            both = ((Stage(fam, v, skey[1]), zs),)
                            if hfam is not None:
                                both += ((Stage(hfam, v, skey[1]), hzs),)
                            stages[skey] = both
                        combo = combine(both[0][0], micro, schedule, m)
                        if best is not None and combo.core > best[0]:
                            continue  # cannot beat this family's best: the rest of a step only adds time
                        for stage, stage_zs in both:
                            for z in stage_zs:
                                self.evaluated += 1
                                step, mem = finish(stage, combo, z)
                                if mem > cap:
                                    if mem < lean:
                                        lean = mem
                                        lean_desc = describe(candidate_layout(stage, micro, combo, z))
                                    continue
                                cand = (step, z, mem, stage, micro, combo)
                                if self.first_fit:
                                    self.best = cand
                                    return True
                                if better(cand, best):
                                    best = cand
        self._settle(key, name, best, lean, lean_desc)
        return False

    def _settle(self, key: tuple[int, ...], name: str, best: Candidate | None, lean: float,
                lean_desc: str) -> None:
        """Record a searched family: its best candidate, or why none fits."""
        if best is None:
            if lean < math.inf:
                self._reject(
                    name,
                    f"needs {fmt_bytes(lean)} > {fmt_bytes(self.env.capacity)} per GPU even at its leanest "
                    f"({lean_desc})",
                )
                self.fam_leanest[key] = (lean, lean_desc)
            return
        self.fam_best[best[3].fam.key()] = best  # keyed by the winner's r (plan_from_search)
        if better(best, self.best):
            self.best = best


def fits_within(env: Env, zero_stages: Sequence[int], schedules: Sequence[str], budget: int) -> bool:
    s = CandidateSearch(env, zero_stages, schedules, first_fit=True, budget=budget)
    s.run()
    return s.best is not None


def smallest_fitting(env: Env, zero_stages: Sequence[int], schedules: Sequence[str]) -> int | None:
    """Smallest whole-node cluster that fits: doubling to bracket it, then a coarse scan of the bracket."""
    c, gpn = env.cluster, env.cluster.node_size

    def fits(n: int) -> bool:
        return fits_within(Env(env.model, env.train, c.with_gpus(n)), zero_stages, schedules,
                           MAX_CANDIDATES // 20)

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


def validate_layout(env: Env, layout: Layout) -> None:
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


def detail_for(env: Env, layout: Layout) -> Detail:
    validate_layout(env, layout)
    fam = Family(env, layout.tp, layout.cp, layout.pp, layout.dp, layout.ep, layout.dp_replicate)
    stage = Stage(fam, layout.virtual_stages, layout.schedule in V_SHAPED)
    micro = Micro(fam, layout.micro_batch_size, layout.sequence_parallel, layout.recompute)
    combo = combine(stage, micro, layout.schedule, layout.num_microbatches)
    return build_detail(stage, micro, combo, layout.zero_stage, layout)

