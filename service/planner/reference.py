"""The unpruned reference search: every valid layout, each predicted on its own through `evaluate`.

Slow (no hoisting, no pruning); the tests and bench/planner.py use it to check that the real search
finds the same best step time, and to measure how much the hoisting and pruning buy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from service.planner.candidates import (
    DEFAULT_SCHEDULES,
    MAX_MICRO_BATCH,
    MIN_CP_TOKENS,
    RECOMPUTE,
    detail_for,
    divisors,
    hsdp_replicas,
    schedule_options,
)
from service.planner.costmodel import Env
from service.planner.specs import ClusterSpec, TrainSpec
from training.config.layout import Layout
from training.config.spec import ModelSpec


def valid_layouts(
    model: ModelSpec,
    train: TrainSpec,
    cluster: ClusterSpec,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
) -> Iterator[Layout]:
    """Every layout the search's rules allow (MoE models: every ep dividing the experts and dp x cp;
    ZeRO-2/3 also with the family's one HSDP split, candidates.hsdp_replicas), in no particular order."""
    n, gpn, rack = cluster.num_gpus, cluster.gpn, cluster.rack_size
    s, g = train.seq_len, train.global_batch
    for tp in divisors(gpn):
        if model.heads % tp or model.n_kv_heads % tp or n % tp:
            continue
        for cp in divisors(n // tp):
            if s % cp or (cp > 1 and s // cp < MIN_CP_TOKENS):
                continue
            if n > rack and (tp * cp > rack or rack % (tp * cp)):
                continue
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                if pp > model.layers or dp > g or g % dp:
                    continue
                eps = divisors(math.gcd(model.num_experts, dp * cp)) if model.is_moe else [1]
                for ep in eps:
                    hr = hsdp_replicas(gpn, tp, cp, dp, ep)
                    rs = [(z, r) for z in zero_stages for r in ((1, hr) if hr > 1 and z >= 2 else (1,))]
                    for mbs in divisors(g // dp):
                        if mbs > MAX_MICRO_BATCH:
                            continue
                        m = g // dp // mbs
                        for schedule, v in schedule_options(pp, m, model.layers, schedules):
                            for sp in (True, False) if tp > 1 else (False,):
                                for rc in RECOMPUTE:
                                    for z, r in rs:
                                        yield Layout(
                                            tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=z,
                                            micro_batch_size=mbs, num_microbatches=m, schedule=schedule,
                                            sequence_parallel=sp, recompute=rc, virtual_stages=v,
                                            dp_replicate=r,
                                        )  # fmt: skip


def reference_best(
    model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, zero_stages: Sequence[int] = (0, 1, 2, 3)
) -> tuple[Layout | None, float, int]:
    """(fastest fitting layout, its step time, layouts evaluated) by brute force."""
    env = Env(model, train, cluster)
    best: Layout | None = None
    best_t = float("inf")
    count = 0
    for layout in valid_layouts(model, train, cluster, zero_stages):
        count += 1
        d = detail_for(env, layout)
        if d.fits and d.step_time_s < best_t:
            best, best_t = layout, d.step_time_s
    return best, best_t, count
