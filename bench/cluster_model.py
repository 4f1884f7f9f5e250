"""The simulated cluster's inputs and yardsticks for bench/cluster_sim.py: the job trace, the
failure rate, checkpoint and restart costs, the Young/Daly interval, the weighted max-min fair
allocation and Jain's index. Pure Python, seeded; no service code (the simulator imports that).

Assumptions (printed by the simulator, and in docs/benchmarks.md):

- failures: Llama 3's rate, 419 unexpected interruptions in 54 days of pre-training on 16,384
  H100 GPUs, 78% of them hardware (Dubey et al. 2024, "The Llama 3 Herd of Models", section
  3.3.4, Table 5), as a Poisson process over the cluster's nodes; a hardware fault takes its node
  out for `REPAIR_S`, a software one only ends the jobs on it;
- restart: 4.40 s kill -> first step for Lattice's full restart of a DP-2 job on one node
  (docs/benchmarks.md, `bench.recovery`, 2026-12-01), scaled by 1 + log2(nodes) for the
  rendezvous and checkpoint load of a larger job (our assumption: ~49 s at 1,024 nodes);
- checkpoint cost: the time a save stalls training, `CHECKPOINT_S` (our assumption: the blocking
  part of an async sharded save, each rank writing its own shard, so independent of size);
- a fixed interval of `FIXED_INTERVAL_S` (one hour) against Young/Daly's per job.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass

GPUS_PER_NODE = 8
NODES_PER_RACK = 16
NODES = 2048  # 16,384 GPUs

# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_HARDWARE = 419, 54, 16_384, 0.78
RESTART_MEASURED_S = 4.40  # bench.recovery, Lattice full restart, 2026-12-01 (docs/benchmarks.md)
CHECKPOINT_S = 10.0  # assumed stall per checkpoint save
FIXED_INTERVAL_S = 3600.0  # the fixed default the Young/Daly interval is compared with
REPAIR_S = 4 * 3600.0  # assumed time a node with a hardware fault is out


def mtbf_s(gpus: int) -> float:
    """Mean time between interruptions of a job on `gpus` GPUs, at Llama 3's rate per GPU."""
    return LLAMA3_DAYS * 86_400 / LLAMA3_INTERRUPTIONS * LLAMA3_GPUS / max(1, gpus)


def young_daly_interval(checkpoint_s: float, mtbf: float) -> float:
    """Optimal compute time between checkpoints: sqrt(2 C M) (Young 1974, "A first order
    approximation to the optimum checkpoint interval"; Daly 2006 shows it is the first-order term)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf)


def restart_s(gpus: int) -> float:
    """Time from a failure to the first step again: the measured restart scaled by 1 + log2(nodes)."""
    return RESTART_MEASURED_S * (1.0 + math.log2(max(1, gpus // GPUS_PER_NODE)))


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    tenant: str
    gpus: int
    priority: int
    submit_s: float
    work_s: float  # useful compute time at its size
    estimate_s: float  # what the scheduler is told (the planner's prediction: off by up to ~2x)


# Tenants: fair-share weight, and the share of the submitted jobs (the small-weight tenants submit
# the most, so shares by demand, FIFO's, differ from shares by weight).
TENANTS: Mapping[str, tuple[float, float]] = {
    "research": (4.0, 0.20), "product": (2.0, 0.20), "eval": (1.0, 0.30), "interns": (1.0, 0.30),
}


def make_trace(n_jobs: int, *, seed: int = 0, load: float = 1.2, nodes: int = NODES) -> list[TraceJob]:
    """`n_jobs` jobs, sizes 8..min(8192, cluster) GPUs (P(8 * 2^k) ~ 0.5^k), log-normal run times
    (median 1 h, sigma 1.3: a heavy tail of multi-day jobs), Poisson arrivals offering `load` x the
    cluster's GPU-seconds over the arrival window."""
    rng = random.Random(seed)
    capacity = nodes * GPUS_PER_NODE
    sizes = [GPUS_PER_NODE * 2 ** k for k in range(11) if GPUS_PER_NODE * 2 ** k <= min(8192, capacity)]
    size_weights = [0.5 ** k for k in range(len(sizes))]
    names = list(TENANTS)
    demand = [TENANTS[t][1] for t in names]
    drawn = []
    for i in range(n_jobs):
        gpus = rng.choices(sizes, size_weights)[0]
        work = min(max(rng.lognormvariate(math.log(3600.0), 1.3), 300.0), 7 * 86_400.0)
        priority = rng.choices([0, 10, 100], [0.8, 0.15, 0.05])[0]
        drawn.append((f"j{i:05d}", rng.choices(names, demand)[0], gpus, priority, work))
    span = sum(g * w for _, _, g, _, w in drawn) / (load * capacity)
    t = 0.0
    jobs = []
    for job_id, tenant, gpus, priority, work in drawn:
        t += rng.expovariate(n_jobs / span)
        estimate = work * rng.lognormvariate(0.0, 0.3)
        jobs.append(TraceJob(job_id, tenant, gpus, priority, t, work, estimate))
    return jobs


def weighted_fair(capacity: float, demand: Mapping[str, float],
                  weights: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair allocation of `capacity` (water-filling): no tenant gets more than it
    asks for, and the rest is split in proportion to weight (Bertsekas and Gallager, Data Networks,
    section 6.5.2)."""
    left = {t: d for t, d in demand.items() if d > 0}
    out = dict.fromkeys(demand, 0.0)
    cap = capacity
    while left and cap > 1e-9:
        total_w = sum(weights[t] for t in left)
        level = cap / total_w
        satisfied = {t for t, d in left.items() if d <= level * weights[t]}
        if not satisfied:
            for t in left:
                out[t] += level * weights[t]
            break
        for t in satisfied:
            out[t] += left[t]
            cap -= left[t]
            del left[t]
    return out


def jain(values: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all equal, 1/n when one has all (Jain,
    Chiu and Hawe 1984, DEC-TR-301)."""
    squares = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * squares) if squares > 0 else 1.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def run_with_failures(work_s: float, gpus: int, interval_s: float, failures: list[float]) -> float:
    """Wall time for one job to do `work_s` of compute with a checkpoint (`CHECKPOINT_S`) every
    `interval_s` of it, a restart before the first step and after every failure, and failures at
    the given gaps (seconds of wall time after each (re)start; the last gap is never used up)."""
    restart, wall, done = restart_s(gpus), 0.0, 0.0
    for gap in failures:
        left = work_s - done
        needed = restart + left + max(0, math.ceil(left / interval_s) - 1) * CHECKPOINT_S
        if gap >= needed:
            return wall + needed
        cycles = math.floor(max(0.0, gap - restart) / (interval_s + CHECKPOINT_S))
        done += min(left, cycles * interval_s)
        wall += gap
    raise ValueError("ran out of failure gaps: pass more")


def checkpoint_goodput(trace: list[TraceJob], *, young_daly: bool, seed: int, replicas: int = 20,
                       min_gpus: int = 0) -> float:
    """Useful GPU-seconds / allocated GPU-seconds of the trace's jobs (those with >= min_gpus), each
    run alone `replicas` times under Llama 3's failure rate, with Young/Daly's interval or the fixed
    one. Both choices see the same failure gaps (common random numbers: the seed per job and
    replica), so the difference is the interval's, not the luck's."""
    useful = allocated = 0.0
    for i, job in enumerate(trace):
        if job.gpus < min_gpus:
            continue
        mtbf = mtbf_s(job.gpus)
        interval = young_daly_interval(CHECKPOINT_S, mtbf) if young_daly else FIXED_INTERVAL_S
        for r in range(replicas):
            rng = random.Random(seed * 1_000_003 + i * 1009 + r)
            gaps = [rng.expovariate(1.0 / mtbf) for _ in range(64)]
            while True:
                try:
                    wall = run_with_failures(job.work_s, job.gpus, interval, gaps)
                    break
                except ValueError:
                    gaps += [rng.expovariate(1.0 / mtbf) for _ in range(64)]
            useful += job.gpus * job.work_s
            allocated += job.gpus * wall
    return useful / allocated if allocated else 1.0
