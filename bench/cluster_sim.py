"""`python -m bench.cluster_sim`: the scheduler's own decision functions on a simulated 16,384-GPU
cluster and clock.

The simulator calls the code the service calls, not a copy: `DECIDE` is
`service.scheduler.fairshare.decide` (what `service.scheduler.admission.queue_decisions` calls
each tick), `FIFO` the policy before it (`fifo_decide`), `PLACE` is `workers.placement.place`,
`CHOOSE_VICTIMS` is `service.scheduler.preemption.choose_victims`.
Each scheduling pass hands the waiting jobs, the running jobs (their ETAs) and the free GPUs to
the policy, then places every job it starts on the simulated topology (2,048 nodes of 8 GPUs,
racks of 16 nodes). Nodes fail at Llama 3's rate; a failed job loses the work since its last
checkpoint, pays a restart, and queues again. The inputs and their sources: bench/cluster_model.py.

Printed, for fair share and for FIFO with priority (today's policy) on the same trace: decision
latency (CPU per decision, with 1,000 waiting jobs and in the run), GPU utilisation over the
arrival window, goodput (useful GPU-hours / allocated GPU-hours), Jain's index of the tenants'
allocations against their weighted max-min fair shares, preemptions and steps lost to them (a
third run, fair share that preempts lower-priority jobs for the head of the line; a preempted job
checkpoints on the notice and loses no step), and the goodput of Young/Daly intervals against a
fixed one (each job alone under the same failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench import cluster_model as cm
from service.scheduler import fairshare, preemption
from training.config.layout import Layout
from workers.placement import PlacementError, place
from workers.topology import NodeInfo, Topology

DECIDE = fairshare.decide
FIFO = fairshare.fifo_decide
PLACE = place
CHOOSE_VICTIMS = preemption.choose_victims
Policy = Callable[..., list[fairshare.Decision]]
REPLICAS = 20  # runs of each job alone in the checkpoint-interval comparison


@dataclass
class SimJob:
    trace: cm.TraceJob
    interval_s: float  # compute time between checkpoints
    remaining_s: float  # useful work not yet checkpointed or finished
    segment: int = 0  # bumped at every start and stop: an end event of an older segment is stale
    started_at: float = 0.0
    startup_s: float = 0.0
    ends_at: float = 0.0
    nodes: dict[str, int] = field(default_factory=dict)
    view: fairshare.WaitingJob | None = None  # what the policy sees while it waits

    def waiting(self) -> fairshare.WaitingJob:
        if self.view is None:  # its estimate shrinks with the work it has kept
            t = self.trace
            self.view = fairshare.WaitingJob(t.job_id, t.tenant, t.gpus, t.priority, t.submit_s,
                                             t.estimate_s * self.remaining_s / t.work_s)
        return self.view


@dataclass
class Result:
    policy: str
    interval: str
    utilisation: float
    goodput: float
    jain: float
    failures: int
    jobs_hit: int
    gpu_hours_lost: float
    mean_wait_h: float
    decide_cpu_s: list[float]
    place_cpu_s: list[float]
    preemptions: int = 0
    steps_lost_to_preemption: int = 0  # a preempted job checkpoints on the notice: it loses no step


class Simulation:
    def __init__(self, trace: Sequence[cm.TraceJob], policy: Policy, *, young_daly: bool, nodes: int,
                 seed: int, preempt: bool = False) -> None:
        self.policy, self.rng, self.preempt = policy, random.Random(seed), preempt
        self.preemptions = 0
        self.jobs = {t.job_id: SimJob(t, self._interval(t.gpus, young_daly), t.work_s) for t in trace}
        self.tenants = {name: fairshare.TenantPolicy(name, weight=w) for name, (w, _) in cm.TENANTS.items()}
        self.nodes = [NodeInfo(node_id=f"r{r}-n{n}", name=f"r{r}-n{n}", rack=f"r{r}",
                               gpus_total=cm.GPUS_PER_NODE, gpus_free=cm.GPUS_PER_NODE)
                      for r in range(nodes // cm.NODES_PER_RACK) for n in range(cm.NODES_PER_RACK)]
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        # Live nodes with free GPUs: placement is handed these, its answer the same as on all nodes
        # (a full or dead node takes no rank) with less to scan.
        self.open = set(range(len(self.nodes)))
        self.on_node: dict[str, set[str]] = defaultdict(set)
        self.free = self.up = nodes * cm.GPUS_PER_NODE  # free GPUs on live nodes; GPUs of live nodes
        self.held: dict[str, float] = defaultdict(float)  # GPUs each tenant's running jobs hold
        self.demand: dict[str, float] = defaultdict(float)  # GPUs each tenant's waiting jobs want
        self.waiting: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}
        self.running_views: dict[str, fairshare.RunningJob] = {}  # what the policy sees of them
        self.events: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.window_end = max(t.submit_s for t in trace)
        self.now = self.last = 0.0
        self.busy = self.capacity = self.allocated = self.useful = self.lost = self.wait = 0.0
        self.held_area: dict[str, float] = defaultdict(float)
        self.fair_area: dict[str, float] = defaultdict(float)
        self.failures = self.jobs_hit = 0
        self.decide_cpu: list[float] = []
        self.place_cpu: list[float] = []

    @staticmethod
    def _interval(gpus: int, young_daly: bool) -> float:
        if not young_daly:
            return cm.FIXED_INTERVAL_S
        return cm.young_daly_interval(cm.CHECKPOINT_S, cm.mtbf_s(gpus))

    def _push(self, at: float, kind: str, key: str, segment: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, key, segment))

    # ---- the run ------------------------------------------------------------------------------------
    def run(self) -> None:
        for job in self.jobs.values():
            self._push(job.trace.submit_s, "arrive", job.trace.job_id)
        node_rate = 1.0 / cm.mtbf_s(cm.GPUS_PER_NODE)
        self._push(self.rng.expovariate(node_rate * len(self.nodes)), "fail", "")
        unfinished = len(self.jobs)
        while self.events and unfinished:
            at, _, kind, key, segment = heapq.heappop(self.events)
            self._account(at)
            if kind == "arrive":
                job = self._queue(self.jobs[key])
                if job.trace.gpus > self.free:
                    continue  # it cannot start now, and nothing else changed
            elif kind == "end":
                if key not in self.running or self.running[key].segment != segment:
                    continue  # the job failed before this end
                self._stop(self.running[key], finished=True)
                unfinished -= 1
            elif kind == "fail":
                self._fail(self.rng.randrange(len(self.nodes)))
                self._push(at + self.rng.expovariate(node_rate * len(self.nodes)), "fail", "")
            elif kind == "repair":
                self._set_node(key, alive=True)
            self._schedule()

    def _account(self, at: float) -> None:
        """Integrate GPUs held and weighted fair shares over the arrival window up to `at`."""
        start, end = self.last, min(at, self.window_end)
        self.now = self.last = at
        if end <= start:
            return
        dt = end - start
        self.busy += sum(self.held.values()) * dt
        self.capacity += self.up * dt
        want = {t: self.held[t] + self.demand[t] for t in self.tenants}
        fair = cm.weighted_fair(self.up, want, {t: p.weight for t, p in self.tenants.items()})
        for t in self.tenants:
            self.held_area[t] += self.held[t] * dt
            self.fair_area[t] += fair[t] * dt

    def _queue(self, job: SimJob) -> SimJob:
        self.waiting[job.trace.job_id] = job
        self.demand[job.trace.tenant] += job.trace.gpus
        return job

    def _unqueue(self, job_id: str) -> SimJob:
        job = self.waiting.pop(job_id)
        self.demand[job.trace.tenant] -= job.trace.gpus
        return job

    # ---- scheduling ----------------------------------------------------------------------------------
    def _schedule(self) -> None:
        waiting = [j.waiting() for j in self.waiting.values()]
        if not waiting:
            return
        running = list(self.running_views.values())
        cpu = time.process_time()
        decisions = self.policy(waiting, running, self.tenants, free_gpus=self.free, now=self.now)
        self.decide_cpu.append(time.process_time() - cpu)
        for d in decisions:
            if not d.start:
                break  # the starts come first
            cpu = time.process_time()
            try:
                layout = Layout(tp=cm.GPUS_PER_NODE, dp=d.gpus // cm.GPUS_PER_NODE)
                placement = PLACE(layout, Topology(tuple(self.nodes[i] for i in self.open)))
            except PlacementError:
                continue  # the GPUs are free but not in the shape the layout needs
            finally:
                self.place_cpu.append(time.process_time() - cpu)
            nodes: dict[str, int] = defaultdict(int)
            for r in placement.ranks:
                nodes[r.node_name] += 1
            self._start(self._unqueue(d.job_id), dict(nodes))
        head = next((d for d in decisions if d.kind == fairshare.HEAD), None)
        if self.preempt and head is not None:
            self._make_room(head)

    def _make_room(self, head: fairshare.Decision) -> None:
        """Preempt lower-priority jobs for the head of the line (CHOOSE_VICTIMS, the service's):
        each checkpoints at its next step boundary on the notice (0 steps lost, one checkpoint's
        stall), stops and queues again; the head starts on the GPUs they free."""
        job = self.waiting[head.job_id]
        candidates = [preemption.Candidate(j.trace.job_id, j.trace.gpus, j.trace.priority,
                                           steps_since_checkpoint=int(self._since_checkpoint(j)))
                      for j in self.running.values()]
        victims = CHOOSE_VICTIMS(head.gpus, self.free, job.trace.priority, candidates)
        if not victims:
            return
        for v in victims:
            self._stop(self.running[v.job_id], finished=False, preempted=True)
        self.preemptions += len(victims)
        layout = Layout(tp=cm.GPUS_PER_NODE, dp=head.gpus // cm.GPUS_PER_NODE)
        try:
            placement = PLACE(layout, Topology(tuple(self.nodes[i] for i in self.open)))
        except PlacementError:
            return  # the victims queue again, having lost nothing
        nodes: dict[str, int] = defaultdict(int)
        for r in placement.ranks:
            nodes[r.node_name] += 1
        self._start(self._unqueue(head.job_id), dict(nodes))

    def _since_checkpoint(self, job: SimJob) -> float:
        """Compute time since the job's last checkpoint (what a failure now would lose)."""
        productive = max(0.0, self.now - job.started_at - job.startup_s)
        return productive % (job.interval_s + cm.CHECKPOINT_S)

    def _start(self, job: SimJob, nodes: dict[str, int]) -> None:
        job.segment += 1
        job.nodes, job.started_at, job.startup_s = nodes, self.now, cm.restart_s(job.trace.gpus)
        for name, gpus in nodes.items():
            self._take(name, gpus)
            self.on_node[name].add(job.trace.job_id)
        checkpoints = max(0, math.ceil(job.remaining_s / job.interval_s) - 1)  # none after the last step
        job.ends_at = self.now + job.startup_s + job.remaining_s + checkpoints * cm.CHECKPOINT_S
        if job.segment == 1:
            self.wait += self.now - job.trace.submit_s
        self.held[job.trace.tenant] += job.trace.gpus
        self.running[job.trace.job_id] = job
        self.running_views[job.trace.job_id] = fairshare.RunningJob(job.trace.job_id, job.trace.tenant,
                                                                    job.trace.gpus, job.ends_at)
        self._push(job.ends_at, "end", job.trace.job_id, job.segment)

    def _stop(self, job: SimJob, *, finished: bool, preempted: bool = False) -> None:
        """Release the job's GPUs and book its segment: allocated time, and the work it kept (all of
        it when preempted: the notice's checkpoint, whose stall is counted as held time)."""
        elapsed = self.now - job.started_at
        if finished:
            kept = job.remaining_s
        elif preempted:
            productive = max(0.0, elapsed - job.startup_s)
            cycles = math.floor(productive / (job.interval_s + cm.CHECKPOINT_S))
            kept = min(job.remaining_s, cycles * job.interval_s
                       + min(job.interval_s, productive - cycles * (job.interval_s + cm.CHECKPOINT_S)))
            elapsed += cm.CHECKPOINT_S
        else:  # the work since the last checkpoint is lost
            cycles = math.floor(max(0.0, elapsed - job.startup_s) / (job.interval_s + cm.CHECKPOINT_S))
            kept = min(job.remaining_s, cycles * job.interval_s)
        gpus = job.trace.gpus
        self.allocated += gpus * elapsed
        self.useful += gpus * kept
        job.remaining_s -= kept
        job.view = None
        job.segment += 1
        del self.running[job.trace.job_id]
        del self.running_views[job.trace.job_id]
        self.held[job.trace.tenant] -= gpus
        for name, n in job.nodes.items():
            self._take(name, -n)
            self.on_node[name].discard(job.trace.job_id)
        job.nodes = {}
        if not finished:
            self.lost += gpus * (elapsed - kept)
            self._queue(job)

    def _fail(self, i: int) -> None:
        """A node fails: its jobs stop and queue again; a hardware fault takes it out for a while."""
        self.failures += 1
        name = self.nodes[i].name
        for job_id in sorted(self.on_node[name]):
            self.jobs_hit += 1
            self._stop(self.running[job_id], finished=False)
        if self.rng.random() < cm.LLAMA3_HARDWARE and self.nodes[i].alive:
            self._set_node(name, alive=False)
            self._push(self.now + cm.REPAIR_S, "repair", name)

    def _take(self, name: str, gpus: int) -> None:
        i = self.index[name]
        self.nodes[i] = dataclasses.replace(self.nodes[i], gpus_free=self.nodes[i].gpus_free - gpus)
        if self.nodes[i].alive:
            self.free -= gpus
        self._reopen(i)

    def _set_node(self, name: str, *, alive: bool) -> None:
        i = self.index[name]
        if self.nodes[i].alive != alive:
            sign = 1 if alive else -1
            self.free += sign * self.nodes[i].gpus_free
            self.up += sign * self.nodes[i].gpus_total
        self.nodes[i] = dataclasses.replace(self.nodes[i], alive=alive)
        self._reopen(i)

    def _reopen(self, i: int) -> None:
        if self.nodes[i].alive and self.nodes[i].gpus_free > 0:
            self.open.add(i)
        else:
            self.open.discard(i)

    def result(self, policy: str, interval: str) -> Result:
        shares = [self.held_area[t] / self.fair_area[t] for t in self.tenants if self.fair_area[t] > 0]
        return Result(policy, interval, self.busy / max(self.capacity, 1e-9),
                      self.useful / max(self.allocated, 1e-9), cm.jain(shares), self.failures,
                      self.jobs_hit, self.lost / 3600.0, self.wait / max(1, len(self.jobs)) / 3600.0,
                      self.decide_cpu, self.place_cpu, self.preemptions)


def simulate(trace: Sequence[cm.TraceJob], policy: Policy, *, young_daly: bool, nodes: int,
             seed: int, preempt: bool = False) -> Simulation:
    sim = Simulation(trace, policy, young_daly=young_daly, nodes=nodes, seed=seed, preempt=preempt)
    sim.run()
    return sim


def decision_latency(policy: Policy, *, waiting_jobs: int, rounds: int, nodes: int, seed: int) -> list[float]:
    """CPU seconds per decision with `waiting_jobs` waiting and the cluster full of running jobs."""
    trace = cm.make_trace(2 * waiting_jobs, seed=seed + 1, nodes=nodes)
    capacity, held = nodes * cm.GPUS_PER_NODE, 0
    running = []
    for t in trace[waiting_jobs:]:
        if held + t.gpus <= capacity:
            running.append(fairshare.RunningJob(t.job_id, t.tenant, t.gpus, ends_at=t.work_s))
            held += t.gpus
    waiting = [fairshare.WaitingJob(t.job_id, t.tenant, t.gpus, t.priority, t.submit_s, t.estimate_s)
               for t in trace[:waiting_jobs]]
    tenants = {name: fairshare.TenantPolicy(name, weight=w) for name, (w, _) in cm.TENANTS.items()}
    times = []
    for _ in range(rounds):
        cpu = time.process_time()
        policy(waiting, running, tenants, free_gpus=capacity - held, now=0.0)
        times.append(time.process_time() - cpu)
    return times


def _ms(values: list[float], q: float) -> str:
    return f"{cm.percentile(values, q) * 1000:.2f} ms"


def _report(results: list[Result], latency: dict[str, list[float]], waiting_jobs: int,
            checkpoints: dict[str, tuple[float, float]]) -> None:
    for name, times in latency.items():
        print(f"decision latency, {name}, {waiting_jobs:,} waiting jobs ({len(times)} decisions, CPU): "
              f"p50 {_ms(times, 50)}, p99 {_ms(times, 99)} (target p99 < 50 ms)")
    print()
    print(f"{'policy':<15}{'interval':<12}{'utilisation':>12}{'goodput':>9}{'Jain':>7}{'preemptions':>13}"
          f"{'steps lost':>12}{'node faults':>13}{'jobs hit':>10}{'GPU-h lost':>12}{'mean wait':>11}")
    for r in results:
        print(f"{r.policy:<15}{r.interval:<12}{r.utilisation:>12.1%}{r.goodput:>9.1%}{r.jain:>7.3f}"
              f"{r.preemptions:>13}{r.steps_lost_to_preemption:>12}{r.failures:>13}{r.jobs_hit:>10}"
              f"{r.gpu_hours_lost:>12.0f}{r.mean_wait_h:>10.2f}h")
    for r in results:
        print(f"in the run, {r.policy} ({r.interval}): {len(r.decide_cpu_s)} decisions "
              f"p50 {_ms(r.decide_cpu_s, 50)} p99 {_ms(r.decide_cpu_s, 99)}; "
              f"placement per started job p50 {_ms(r.place_cpu_s, 50)} p99 {_ms(r.place_cpu_s, 99)}")
    fair, fifo, preempting = results
    print()
    print(f"Jain's index: fair share {fair.jain:.3f}, FIFO {fifo.jain:.3f} (target >= 0.95)")
    print(f"utilisation: fair share {fair.utilisation:.1%}, FIFO {fifo.utilisation:.1%}: "
          f"{(fair.utilisation - fifo.utilisation) * 100:+.1f} points (target >= -3)")
    print(f"goodput: {fair.goodput:.1%} (target >= 90%)")
    for label, (young_daly, fixed) in checkpoints.items():
        print(f"Young/Daly vs fixed {cm.FIXED_INTERVAL_S / 3600:g} h interval, {label}: "
              f"goodput {young_daly:.2%} vs {fixed:.2%} ({(young_daly - fixed) * 100:+.2f} points)")
    print(f"preemptions (fair share with preemption for higher-priority heads): {preempting.preemptions}, "
          f"steps lost to them: {preempting.steps_lost_to_preemption} (each checkpoints on the notice); "
          "the first two rows preempt nothing")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster_sim", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, help="jobs in the trace (default 3000; --quick 100)")
    parser.add_argument("--nodes", type=int, help=f"nodes of 8 GPUs, a multiple of 16 (default {cm.NODES}; "
                        "--quick 64)")
    parser.add_argument("--load", type=float, default=1.6, help="offered GPU-seconds / capacity")
    parser.add_argument("--waiting", type=int, help="waiting jobs in the latency benchmark (default 1000; "
                        "--quick 100)")
    parser.add_argument("--rounds", type=int, help="decisions timed in the latency benchmark (default 200; "
                        "--quick 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small run, for tests")
    args = parser.parse_args(argv)
    sizes = (100, 64, 100, 5) if args.quick else (3000, cm.NODES, 1000, 200)
    for name, default in zip(("jobs", "nodes", "waiting", "rounds"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    trace = cm.make_trace(args.jobs, seed=args.seed, load=args.load, nodes=args.nodes)
    weights = ", ".join(f"{t} {w:g}" for t, (w, _) in cm.TENANTS.items())
    print(f"cluster: {args.nodes * cm.GPUS_PER_NODE:,} GPUs ({args.nodes:,} nodes x {cm.GPUS_PER_NODE}, "
          f"racks of {cm.NODES_PER_RACK} nodes); trace: {len(trace):,} jobs, {len(cm.TENANTS)} tenants "
          f"(weights {weights}), load {args.load:g}, seed {args.seed}")
    print(f"failures: Llama 3's rate, job MTBF {cm.mtbf_s(cm.LLAMA3_GPUS) / 3600:.2f} h at 16,384 GPUs, "
          f"{cm.LLAMA3_HARDWARE:.0%} hardware (node out {cm.REPAIR_S / 3600:g} h); "
          f"checkpoint {cm.CHECKPOINT_S:g} s (assumed); restart {cm.RESTART_MEASURED_S} s x (1 + log2 nodes) "
          "(bench.recovery, scaled)")
    latency = {name: decision_latency(fn, waiting_jobs=args.waiting, rounds=args.rounds, nodes=args.nodes,
                                      seed=args.seed)
               for name, fn in (("fair share", DECIDE), ("FIFO", FIFO))}
    results = []
    for policy, fn, preempt in (("fair share", DECIDE, False), ("FIFO+priority", FIFO, False),
                                ("fair+preempt", DECIDE, True)):
        sim = simulate(trace, fn, young_daly=True, nodes=args.nodes, seed=args.seed, preempt=preempt)
        results.append(sim.result(policy, "Young/Daly"))
    # The interval's effect apart from the schedule's: each job alone, the same failures for both.
    checkpoints: dict[str, tuple[float, float]] = {}
    big = [("jobs >= 1,024 GPUs", 1024)] if any(t.gpus >= 1024 for t in trace) else []
    for label, least in [("all jobs", 0), *big]:
        young_daly, fixed = (cm.checkpoint_goodput(trace, young_daly=yd, seed=args.seed, replicas=REPLICAS,
                                                   min_gpus=least) for yd in (True, False))
        checkpoints[f"{label} (each alone, {REPLICAS} runs, the same failures)"] = (young_daly, fixed)
    _report(results, latency, args.waiting, checkpoints)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
