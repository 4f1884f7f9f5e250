"""Fair-share order, quotas, borrowing and backfill: pure decisions over numbers."""

from __future__ import annotations

import math

from service.scheduler.fairshare import (
    BACKFILL,
    BLOCKED,
    BORROWING,
    FAIR_SHARE,
    HEAD,
    QUOTA,
    TOO_BIG,
    RunningJob,
    TenantPolicy,
    WaitingJob,
    decide,
    fifo_decide,
    reservation,
)


def _policies(*policies: TenantPolicy) -> dict[str, TenantPolicy]:
    return {p.name: p for p in policies}


def _started(decisions: list) -> list[str]:  # type: ignore[type-arg]
    return [d.job_id for d in decisions if d.start]


def _by_id(decisions: list) -> dict:  # type: ignore[type-arg]
    return {d.job_id: d for d in decisions}


def test_the_tenant_furthest_below_its_weighted_share_goes_first() -> None:
    # a holds 16 GPUs with weight 2 (8 per unit of weight), b holds 8 with weight 1 (8): tie broken by
    # priority; c holds nothing and goes first even with the lowest priority and the newest job.
    running = [RunningJob("ra", "a", 16), RunningJob("rb", "b", 8)]
    waiting = [WaitingJob("a1", "a", 8, priority=5, submitted=1),
               WaitingJob("b1", "b", 8, priority=9, submitted=2),
               WaitingJob("c1", "c", 8, priority=0, submitted=3)]
    tenants = _policies(TenantPolicy("a", weight=2.0), TenantPolicy("b"), TenantPolicy("c"))
    decisions = decide(waiting, running, tenants, free_gpus=24, now=0)
    assert _started(decisions) == ["c1", "b1", "a1"]
    assert all(d.kind == FAIR_SHARE for d in decisions)


def test_within_a_tenant_priority_then_age_and_shares_move_as_jobs_start() -> None:
    waiting = [WaitingJob("old", "a", 8, priority=1, submitted=1), WaitingJob("new-hi", "a", 8, priority=7,
                                                                               submitted=5),
               WaitingJob("b-old", "b", 8, submitted=0), WaitingJob("b-new", "b", 8, submitted=9)]
    decisions = decide(waiting, [], {}, free_gpus=64, now=0)
    # both tenants at 0: a's top job has the higher priority; then b (0 held) before a (8 held) ...
    assert _started(decisions) == ["new-hi", "b-old", "old", "b-new"]


def test_a_job_over_its_tenants_quota_waits_with_the_reason() -> None:
    running = [RunningJob("r1", "a", 8)]
    waiting = [WaitingJob("a2", "a", 8, submitted=1), WaitingJob("a3", "a", 16, submitted=2),
               WaitingJob("b1", "b", 8, submitted=3)]
    tenants = _policies(TenantPolicy("a", gpu_quota=8))
    got = _by_id(decide(waiting, running, tenants, free_gpus=100, now=0))
    assert (got["a2"].start, got["a2"].kind, got["a2"].reason) == (False, QUOTA, "quota: 8 of 8 GPUs in use")
    assert got["a3"].reason == "quota: needs 16 GPUs, the quota is 8"
    assert got["b1"].start  # another tenant is not held back by a's quota


def test_quota_counts_jobs_started_in_the_same_decision_and_not_borrowed_gpus() -> None:
    running = [RunningJob("lent", "a", 8, borrowing=True)]
    waiting = [WaitingJob("a1", "a", 8, submitted=1), WaitingJob("a2", "a", 8, submitted=2)]
    got = _by_id(decide(waiting, running, _policies(TenantPolicy("a", gpu_quota=8)), free_gpus=64, now=0))
    assert got["a1"].start and not got["a1"].borrowing
    assert got["a2"].reason == "quota: 8 of 8 GPUs in use"


def test_borrowing_uses_idle_gpus_after_everyone_within_quota_and_is_marked() -> None:
    running = [RunningJob("r1", "a", 8)]
    waiting = [WaitingJob("a2", "a", 8, priority=100, submitted=0), WaitingJob("b1", "b", 16, submitted=5)]
    tenants = _policies(TenantPolicy("a", gpu_quota=8, borrowing=True), TenantPolicy("b"))
    decisions = decide(waiting, running, tenants, free_gpus=24, now=0)
    assert _started(decisions) == ["b1", "a2"]  # b (within its share) first, then a borrows
    got = _by_id(decisions)
    assert got["a2"].kind == BORROWING and got["a2"].borrowing and "quota: 8 of 8" in got["a2"].reason
    # no idle GPUs left after b: a waits, saying why
    tight = _by_id(decide(waiting, running, tenants, free_gpus=16, now=0))
    assert not tight["a2"].start and tight["a2"].reason == "quota: 8 of 8 GPUs in use; no idle GPUs to borrow"


def test_backfill_runs_a_short_job_that_ends_before_the_heads_reservation() -> None:
    # 8 free; the head needs 32, available at t=100 when the 24-GPU job ends.
    running = [RunningJob("r", "x", 24, ends_at=100.0)]
    waiting = [WaitingJob("head", "a", 32, submitted=0),
               WaitingJob("short", "b", 8, submitted=1, duration_s=50),
               WaitingJob("long", "c", 8, submitted=2, duration_s=500)]
    got = _by_id(decide(waiting, running, {}, free_gpus=8, now=0))
    assert got["head"].kind == HEAD and not got["head"].start
    assert got["head"].reason == "next in line: needs 32 GPUs, 8 free"
    assert got["short"].start and got["short"].kind == BACKFILL
    assert not got["long"].start and got["long"].kind == BLOCKED  # no GPUs left anyway


def test_backfill_never_delays_the_head() -> None:
    running = [RunningJob("r", "x", 24, ends_at=100.0)]
    waiting = [WaitingJob("head", "a", 32, submitted=0),
               WaitingJob("long", "b", 8, submitted=1, duration_s=500),
               WaitingJob("unknown", "c", 8, submitted=2)]
    got = _by_id(decide(waiting, running, {}, free_gpus=8, now=0))
    assert not got["long"].start and got["long"].reason == "would delay head, next in line"
    assert not got["unknown"].start  # unknown length: infinite, cannot end before t=100
    # with 16 free the head still needs the 24 at t=100 (40 then, 8 spare): a long 8-GPU job fits the spare
    got = _by_id(decide(waiting, running, {}, free_gpus=16, now=0))
    assert got["long"].start and got["long"].kind == BACKFILL
    assert not got["unknown"].start  # the 8 spare GPUs are taken by `long`


def test_a_head_whose_start_is_unknown_reserves_all_it_needs() -> None:
    running = [RunningJob("r", "x", 24)]  # no ETA
    waiting = [WaitingJob("head", "a", 32, submitted=0),
               WaitingJob("short", "b", 8, submitted=1, duration_s=1)]
    got = _by_id(decide(waiting, running, {}, free_gpus=8, now=0))
    assert not got["short"].start  # the head's start is unknown: a short job might still delay it
    res = reservation(waiting[0], 8, [(None, 24)])
    assert res.at == math.inf and res.extra == 0
    got = _by_id(decide(waiting, running, {}, free_gpus=16, now=0))
    assert got["short"].start  # 16 + 24 - 32 = 8 spare GPUs even after the head has its GPUs


def test_a_job_bigger_than_the_cluster_does_not_block_the_line() -> None:
    waiting = [WaitingJob("huge", "a", 1024, priority=9), WaitingJob("small", "b", 8, duration_s=None)]
    got = _by_id(decide(waiting, [RunningJob("r", "c", 8)], {}, free_gpus=8, now=0))
    assert got["huge"].kind == TOO_BIG and got["huge"].reason == "needs 1024 GPUs, the cluster has 16"
    assert got["small"].start and got["small"].kind == FAIR_SHARE


def test_fifo_baseline_is_priority_then_age_and_skips_what_does_not_fit() -> None:
    waiting = [WaitingJob("a", "t", 32, priority=1, submitted=0),
               WaitingJob("b", "t", 8, priority=5, submitted=3),
               WaitingJob("c", "u", 8, priority=1, submitted=1)]
    quota = _policies(TenantPolicy("t", gpu_quota=8))
    decisions = fifo_decide(waiting, [RunningJob("r", "x", 16)], quota, free_gpus=16, now=0)
    assert _started(decisions) == ["b", "c"]  # no quota in the old policy, no reservation for `a`
    assert _by_id(decisions)["a"].reason == "needs 32 GPUs, 8 free"
