"""Which queued jobs start now, and why the others wait: weighted fair share, quotas, borrowing and
backfill as pure functions over numbers (no database, no cluster), so the scheduler loop and the
cluster simulation (bench/cluster_sim.py) call the same code.

`decide()`:

1. Quota: a tenant's running jobs hold at most `gpu_quota` GPUs (None: no cap), borrowed GPUs not
   counted. A job that would go over waits ("quota: 8 of 8 GPUs in use"), unless the tenant may
   borrow: then it may run on idle GPUs after every job within its quota has had its turn, marked
   `borrowing` (reclaimable: the GPUs are lent, not owned).
2. Order: the next job comes from the tenant furthest below its weighted share of the cluster,
   i.e. the lowest GPUs held / weight (dominant resource fairness with one resource, GPUs: Ghodsi
   et al. 2011, "Dominant Resource Fairness", weighted as in their section 5), then the highest
   priority, then the oldest.
3. Backfill: the first job in that order that does not fit the free GPUs is the head of the line.
   Its start is reserved for the time enough running jobs will have ended (their ETAs); a later
   job runs ahead only if it ends before that time or fits in the GPUs left over at that time
   after the head's share (EASY backfill: Lifka 1995; Mu'alem and Feitelson 2001). An unknown ETA
   is infinite: a job of unknown length never backfills except into the left-over GPUs, and a head
   whose start is unknown reserves every GPU it will need.

`fifo_decide()` is the policy before this one (priority, then age, the first that fits starts, no
reservation, no quotas): the simulation's baseline.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# Decision kinds: how a job starts, or why it waits.
FAIR_SHARE, BACKFILL, BORROWING = "fair share", "backfill", "borrowing"
HEAD, BLOCKED, QUOTA, TOO_BIG, FIFO = "head", "blocked", "quota", "too big", "fifo"


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    weight: float = 1.0
    gpu_quota: int | None = None  # None: no cap
    borrowing: bool = False  # may run on idle GPUs beyond the quota (reclaimable)


@dataclass(frozen=True)
class WaitingJob:
    job_id: str
    tenant: str
    gpus: int
    priority: int = 0
    submitted: float = 0.0  # seconds on the caller's clock; older goes first
    duration_s: float | None = None  # estimated run time; None: unknown (infinite)


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    tenant: str
    gpus: int
    ends_at: float | None = None  # estimated end on the caller's clock; None: unknown (never)
    borrowing: bool = False


@dataclass(frozen=True)
class Decision:
    job_id: str
    tenant: str
    gpus: int
    start: bool
    kind: str
    reason: str
    borrowing: bool = False


@dataclass
class _Reservation:
    """The head of the line: when its GPUs are expected (`at`) and how many spare GPUs there are
    then besides its own (`extra`, which backfill may use whatever its length)."""

    job_id: str
    at: float
    extra: int

    def admits(self, job: WaitingJob, now: float) -> bool:
        ends = math.inf if job.duration_s is None else now + job.duration_s
        if ends <= self.at < math.inf:  # an unknown start: no length is known to be short enough
            return True
        if job.gpus <= self.extra:
            self.extra -= job.gpus
            return True
        return False


def reservation(head: WaitingJob, free: int, releases: Iterable[tuple[float | None, int]]) -> _Reservation:
    """When `head` can start: the earliest estimated end after which the free GPUs plus those
    released reach its size. Releases of unknown time never come before an infinite start."""
    known = sorted((t, g) for t, g in releases if t is not None)
    unknown = sum(g for t, g in releases if t is None)
    avail = free
    for at, gpus in known:
        avail += gpus
        if avail >= head.gpus:
            return _Reservation(head.job_id, at, avail - head.gpus)
    return _Reservation(head.job_id, math.inf, max(0, avail + unknown - head.gpus))


def _policy(tenants: Mapping[str, TenantPolicy], name: str) -> TenantPolicy:
    return tenants.get(name) or TenantPolicy(name)


def _quota_reason(policy: TenantPolicy, in_quota: int, job: WaitingJob) -> str:
    assert policy.gpu_quota is not None
    if job.gpus > policy.gpu_quota:
        return f"quota: needs {job.gpus} GPUs, the quota is {policy.gpu_quota}"
    return f"quota: {in_quota} of {policy.gpu_quota} GPUs in use"


class _Books:
    """What the decision has given out so far: free GPUs, GPUs held per tenant (all, and within the
    quota), and the releases the head-of-line reservation is computed from."""

    def __init__(self, running: Sequence[RunningJob], free_gpus: int) -> None:
        self.free = free_gpus
        self.total = free_gpus + sum(r.gpus for r in running)
        self.held: dict[str, int] = defaultdict(int)
        self.in_quota: dict[str, int] = defaultdict(int)
        self.releases: list[tuple[float | None, int]] = []
        for r in running:
            self.held[r.tenant] += r.gpus
            if not r.borrowing:
                self.in_quota[r.tenant] += r.gpus
            self.releases.append((r.ends_at, r.gpus))

    def take(self, job: WaitingJob, now: float, *, borrowing: bool) -> None:
        self.free -= job.gpus
        self.held[job.tenant] += job.gpus
        if not borrowing:
            self.in_quota[job.tenant] += job.gpus
        self.releases.append((None if job.duration_s is None else now + job.duration_s, job.gpus))


def decide(waiting: Sequence[WaitingJob], running: Sequence[RunningJob], tenants: Mapping[str, TenantPolicy],
           *, free_gpus: int, now: float) -> list[Decision]:
    """One decision per waiting job, those that start first (in the order they should start), then
    those that wait, each with its reason. Counts GPUs only: the caller places each starting job
    and treats one that does not place as waiting."""
    books = _Books(running, free_gpus)
    queues: dict[str, deque[WaitingJob]] = defaultdict(deque)
    for job in sorted(waiting, key=lambda j: (-j.priority, j.submitted, j.job_id)):
        queues[job.tenant].append(job)

    def key(tenant: str) -> tuple[float, int, float, str]:
        top = queues[tenant][0]
        return (books.held[tenant] / max(_policy(tenants, tenant).weight, 1e-9), -top.priority, top.submitted,
                tenant)

    heap = [(key(t), t) for t in queues]
    heapq.heapify(heap)
    started: list[Decision] = []
    waits: list[Decision] = []
    borrowers: list[tuple[WaitingJob, str]] = []
    head: _Reservation | None = None
    while heap:
        _, tenant = heapq.heappop(heap)
        job = queues[tenant].popleft()
        policy = _policy(tenants, tenant)
        if policy.gpu_quota is not None and books.in_quota[tenant] + job.gpus > policy.gpu_quota:
            reason = _quota_reason(policy, books.in_quota[tenant], job)
            if policy.borrowing:
                borrowers.append((job, reason))
            else:
                waits.append(Decision(job.job_id, tenant, job.gpus, False, QUOTA, reason))
        elif job.gpus > books.total:
            waits.append(Decision(job.job_id, tenant, job.gpus, False, TOO_BIG,
                                  f"needs {job.gpus} GPUs, the cluster has {books.total}"))
        elif head is None and job.gpus <= books.free:
            books.take(job, now, borrowing=False)
            started.append(Decision(job.job_id, tenant, job.gpus, True, FAIR_SHARE,
                                    f"fair share: {tenant} holds the least GPUs for its weight"))
        elif head is None:
            head = reservation(job, books.free, books.releases)
            waits.append(Decision(job.job_id, tenant, job.gpus, False, HEAD,
                                  f"next in line: needs {job.gpus} GPUs, {books.free} free"))
        elif job.gpus <= books.free and head.admits(job, now):
            books.take(job, now, borrowing=False)
            started.append(Decision(job.job_id, tenant, job.gpus, True, BACKFILL,
                                    f"backfill: does not delay {head.job_id}"))
        else:
            waits.append(_blocked(job, books.free, head))
        if queues[tenant]:
            heapq.heappush(heap, (key(tenant), tenant))
    for job, reason in borrowers:
        if job.gpus <= books.free and (head is None or head.admits(job, now)):
            books.take(job, now, borrowing=True)
            started.append(Decision(job.job_id, job.tenant, job.gpus, True, BORROWING,
                                    f"borrowing idle GPUs beyond its quota ({reason})", borrowing=True))
        else:
            waits.append(Decision(job.job_id, job.tenant, job.gpus, False, QUOTA,
                                  f"{reason}; no idle GPUs to borrow"))
    return started + waits


def _blocked(job: WaitingJob, free: int, head: _Reservation) -> Decision:
    if job.gpus > free:
        reason = f"needs {job.gpus} GPUs, {free} free"
    else:
        reason = f"would delay {head.job_id}, next in line"
    return Decision(job.job_id, job.tenant, job.gpus, False, BLOCKED, reason)


def fifo_decide(waiting: Sequence[WaitingJob], running: Sequence[RunningJob],
                tenants: Mapping[str, TenantPolicy], *, free_gpus: int, now: float) -> list[Decision]:
    """The policy before fair share: priority, then age; every job that fits the free GPUs left
    starts, whatever its tenant holds (no quotas, no reservation). `tenants` and `now` are taken
    for the same signature as `decide`."""
    del tenants, now
    total = free_gpus + sum(r.gpus for r in running)
    free = free_gpus
    started: list[Decision] = []
    waits: list[Decision] = []
    for job in sorted(waiting, key=lambda j: (-j.priority, j.submitted, j.job_id)):
        if job.gpus <= free:
            free -= job.gpus
            started.append(Decision(job.job_id, job.tenant, job.gpus, True, FIFO, "fits the free GPUs"))
        elif job.gpus > total:
            waits.append(Decision(job.job_id, job.tenant, job.gpus, False, TOO_BIG,
                                  f"needs {job.gpus} GPUs, the cluster has {total}"))
        else:
            waits.append(Decision(job.job_id, job.tenant, job.gpus, False, BLOCKED,
                                  f"needs {job.gpus} GPUs, {free} free"))
    return started + waits
