"""A tenant takes back the GPUs it lent: a queued job within its tenant's quota that cannot be placed
while other tenants' jobs run on borrowed GPUs (beyond their own quotas) preempts those, whatever their
priority (service.scheduler.preemption.choose_reclaim, sent by notices.Preemptor.make_room, called by
the loop's `_schedule`). Ray's free counts are faked (every GPU taken) and controllers record the
notices they get."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler.attached import Attached
from service.scheduler.loop import Scheduler
from service.scheduler.notices import Preemptor
from service.scheduler.observer import JobMetrics
from service.scheduler.preemption import Candidate, choose_reclaim
from service.settings import Settings
from service.store import tenants as tenant_store
from training.config.layout import Layout
from workers.client import ControllerState
from workers.topology import Topology


class FakeController:
    def __init__(self) -> None:
        self.notices: list[tuple[str, float]] = []

    def preempt(self, reason: str, grace_s: float, timeout_s: float) -> bool:
        self.notices.append((reason, grace_s))
        return True


def _notices(a: Attached) -> list[tuple[str, float]]:
    return a.controller.notices  # type: ignore[attr-defined,no-any-return]


def _running(s: Session, tenant: str, node: str, gpus: int, *, borrowing: bool = False, priority: int = 0,
             preemptible: bool = True) -> Attached:
    store.ensure_tenant(s, tenant)
    job = store.create_job(s, tenant=tenant, name=f"{tenant}-{node}",
                           spec={"preemption": {"preemptible": preemptible}}, plan={"layout": {"dp": gpus}},
                           priority=priority)
    for state in ("queued", "starting", "running"):
        store.transition(s, job.id, state, reason="test")
    if borrowing:
        store.update_progress(s, job.id, progress={"borrowing": True})
    return Attached(job.id, FakeController(), 0, {node: gpus}, JobMetrics(job.id),  # type: ignore[arg-type]
                    controller_state=ControllerState.RUNNING)


def _queued(s: Session, tenant: str, gpus: int) -> str:
    store.ensure_tenant(s, tenant)
    job = store.create_job(s, tenant=tenant, name=f"{tenant}-waits", spec={"train": {"steps": 10}},
                           plan={"layout": {"dp": gpus}, "predicted": {"step_time_s": 1.0}})
    store.transition(s, job.id, "queued", reason="test")
    return job.id


def _full(racks: int = 2) -> Topology:
    """2 nodes of 4 GPUs per rack, every GPU taken in Ray's counts (the attached jobs hold them)."""
    t = Topology.uniform(racks, 2, 4)
    return dataclasses.replace(t, nodes=tuple(dataclasses.replace(n, gpus_free=0) for n in t.nodes))


def test_choose_reclaim_takes_only_other_tenants_borrowed_gpus_within_the_quota() -> None:
    running = [Candidate("b-own", 4, priority=0, tenant="b"),
               Candidate("a-own", 4, priority=0, tenant="a"),
               Candidate("a-lent", 4, priority=9, borrowing=True, tenant="a"),
               Candidate("b-lent", 4, priority=0, borrowing=True, tenant="b"),
               Candidate("c-pinned", 4, priority=0, borrowing=True, tenant="c", preemptible=False)]
    # priority does not matter: b's job takes back what a borrowed, never its own borrowed GPUs
    assert [v.job_id for v in choose_reclaim(4, 0, "b", 8, running) or []] == ["a-lent"]
    assert choose_reclaim(8, 0, "b", 8, running) is None  # 4 held + 8 > quota 8: over its own quota
    assert choose_reclaim(8, 0, "b", None, running) is None  # only 4 lent GPUs are preemptible
    assert choose_reclaim(4, 4, "b", 8, running) == []  # it fits already
    assert choose_reclaim(8, 0, "a", None, running) is None  # b-lent holds 4, c-pinned opted out
    assert [v.job_id for v in choose_reclaim(4, 0, "c", None, running) or []] == ["b-lent"]


@pytest.fixture
def cluster(db_session_factory: sessionmaker[Session]) -> dict[str, Attached]:
    """Tenant a (quota 4, borrowing) holds 4 GPUs of its own and 8 borrowed (one job of those not
    preemptible); tenant b (quota 8) holds 4. The 16 GPUs are all taken."""
    with store.session_scope(db_session_factory) as s:
        tenant_store.update_tenant(s, "a", gpu_quota=4, borrowing=True)
        tenant_store.update_tenant(s, "b", gpu_quota=8)
        jobs = {"a-own": _running(s, "a", "r1-n1", 4, priority=1),
                "a-lent": _running(s, "a", "r1-n2", 4, borrowing=True, priority=9),
                "a-pinned": _running(s, "a", "r2-n1", 4, borrowing=True, preemptible=False),
                "b-own": _running(s, "b", "r2-n2", 4, priority=5)}
    return jobs


def test_an_owner_within_its_quota_preempts_the_borrower_whatever_its_priority(
        db_session_factory: sessionmaker[Session], cluster: dict[str, Attached]) -> None:
    with store.session_scope(db_session_factory) as s:
        waiting = _queued(s, "b", 4)
    attached = {a.job_id: a for a in cluster.values()}
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    # by priority alone nobody makes room: the borrower's priority 9 is higher than the waiting job's 0
    assert p.make_room(waiting, Layout(dp=4), _full(), attached, for_priority=True, reclaim=False) is None
    assert all(_notices(a) == [] for a in cluster.values())
    why = p.make_room(waiting, Layout(dp=4), _full(), attached, for_priority=False, reclaim=True)
    assert why is not None and "reclaiming borrowed GPUs" in why and cluster["a-lent"].job_id in why
    [(reason, _)] = _notices(cluster["a-lent"])
    assert reason == "reclaim: tenant b takes back 4 GPUs lent to tenant a"
    assert _notices(cluster["a-own"]) == _notices(cluster["a-pinned"]) == _notices(cluster["b-own"]) == []
    # the borrower, back in the queue, lets the owner's job start first (the priority path's hold-back)
    assert p.held_back(cluster["a-lent"].job_id) is not None


def test_no_reclaim_beyond_the_owners_quota_or_when_it_would_not_make_room(
        db_session_factory: sessionmaker[Session], cluster: dict[str, Attached]) -> None:
    with store.session_scope(db_session_factory) as s:
        over = _queued(s, "b", 8)  # b holds 4 of its quota of 8: 8 more would be beyond it
        tenant_store.update_tenant(s, "c", gpu_quota=16)
        big = _queued(s, "c", 12)  # within c's quota, but only 4 lent GPUs can be taken back
    attached = {a.job_id: a for a in cluster.values()}
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    assert p.make_room(over, Layout(dp=8), _full(), attached, for_priority=False, reclaim=True) is None
    assert p.make_room(big, Layout(dp=12), _full(), attached, for_priority=False, reclaim=True) is None
    assert all(_notices(a) == [] for a in cluster.values())


def test_a_non_preemptible_borrower_is_left_alone(db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        tenant_store.update_tenant(s, "a", gpu_quota=4, borrowing=True)
        tenant_store.update_tenant(s, "b", gpu_quota=8)
        own = _running(s, "a", "r1-n1", 4)
        pinned = _running(s, "a", "r1-n2", 4, borrowing=True, preemptible=False)
        waiting = _queued(s, "b", 4)
    attached = {a.job_id: a for a in (own, pinned)}
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    assert p.make_room(waiting, Layout(dp=4), _full(racks=1), attached, reclaim=True) is None
    only_owned = {own.job_id: own}  # nothing lent: a reclaim alone looks no further
    assert p.make_room(waiting, Layout(dp=4), _full(racks=1), only_owned, for_priority=False,
                       reclaim=True) is None
    assert _notices(own) == _notices(pinned) == []


class Recorder(Scheduler):
    """The real `_schedule` over fake attached controllers; `_start` only records what would start."""

    def __init__(self, settings: Settings, sf: sessionmaker[Session], attached: dict[str, Attached]) -> None:
        super().__init__(settings, sf)
        self._attached = attached
        self.started: list[str] = []

    def _start(self, job_id: str, version: int, layout: Any, intended: Any, *,
               borrowing: bool = False) -> None:
        self.started.append(job_id)


@pytest.mark.parametrize("reclaim", [True, False])
def test_the_loop_reclaims_for_an_in_quota_job_by_default(
        db_session_factory: sessionmaker[Session], cluster: dict[str, Attached], tmp_path: Path,
        reclaim: bool) -> None:
    with store.session_scope(db_session_factory) as s:
        over = _queued(s, "b", 8)  # beyond b's quota: waits for its quota, reclaims nothing
    attached = {a.job_id: a for a in cluster.values()}
    off = {} if reclaim else {"reclaim_borrowed": False}
    settings = Settings(home=tmp_path, gpu_type="cpu-virtual", **off)
    assert settings.reclaim_borrowed is reclaim
    scheduler = Recorder(settings, db_session_factory, attached)
    scheduler._schedule(_full())  # noqa: SLF001 - the step under test, without Ray
    assert all(_notices(a) == [] for a in cluster.values())
    with store.session_scope(db_session_factory) as s:
        waiting = _queued(s, "b", 4)
    scheduler._schedule(_full())  # noqa: SLF001
    assert scheduler.started == []
    notices = _notices(cluster["a-lent"])
    expected = ["reclaim: tenant b takes back 4 GPUs lent to tenant a"] if reclaim else []
    assert [r for r, _ in notices] == expected
    assert all(_notices(cluster[k]) == [] for k in ("a-own", "a-pinned", "b-own"))
    with db_session_factory() as s:
        reason = store.get_job(s, waiting).reason or ""
        assert ("reclaiming borrowed GPUs" in reason) is reclaim
        assert "quota" in (store.get_job(s, over).reason or "")
