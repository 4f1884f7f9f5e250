"""Preemption from the service's side: the pure victim choice (service.scheduler.preemption), cloud
notice files, and a preempted job going back to `queued` at its checkpoint step (the store's
`requeue_preempted`, reached through the ingest of a PREEMPTED snapshot)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.errors import IllegalTransition
from service.scheduler.attached import Attached
from service.scheduler.ingest import mirror_state
from service.scheduler.notices import Preemptor, note_resumed
from service.scheduler.observer import JobMetrics
from service.scheduler.preemption import Candidate, choose_victims, jobs_on_nodes, read_notices
from service.store.models import Node, NodeHealth
from training.config.layout import Layout
from workers.client import ControllerState
from workers.topology import Topology


def test_victims_are_the_lowest_priority_then_fewest_steps_then_borrowed() -> None:
    running = [Candidate("hi", 4, priority=5), Candidate("lo-many", 4, priority=0, steps_since_checkpoint=9),
               Candidate("lo-few", 4, priority=0, steps_since_checkpoint=1),
               Candidate("lo-few-lent", 4, priority=0, steps_since_checkpoint=1, borrowing=True)]
    assert [v.job_id for v in choose_victims(4, 0, 10, running) or []] == ["lo-few-lent"]
    assert [v.job_id for v in choose_victims(8, 0, 10, running) or []] == ["lo-few-lent", "lo-few"]
    chosen = choose_victims(12, 0, 10, running) or []
    assert [v.job_id for v in chosen] == ["lo-few-lent", "lo-few", "lo-many"]


def test_only_lower_priority_preemptible_jobs_and_only_if_the_job_then_fits() -> None:
    running = [Candidate("same", 4, priority=3), Candidate("pinned", 4, priority=0, preemptible=False),
               Candidate("low", 4, priority=0)]
    assert choose_victims(8, 0, 3, running) is None  # "same" is not lower, "pinned" opted out
    assert choose_victims(8, 4, 3, running) == [running[2]]
    assert choose_victims(4, 4, 3, running) == []  # it fits already: nobody is preempted
    assert choose_victims(4, 0, 0, running) is None  # nothing of lower priority


def test_no_victim_is_kept_whose_gpus_the_others_already_cover() -> None:
    running = [Candidate("small", 2, priority=0), Candidate("big", 8, priority=1)]
    assert [v.job_id for v in choose_victims(8, 0, 5, running) or []] == ["big"]


def test_jobs_on_drained_nodes() -> None:
    placements = [("a", ["r1-n1", "r1-n2"]), ("b", ["r2-n1"]), ("c", [])]
    assert jobs_on_nodes(placements, ["r1-n2"]) == ["a"]
    assert jobs_on_nodes(placements, ["r2-n1", "r1-n1"]) == ["a", "b"]


def test_cloud_notice_files_act_once(tmp_path: Path) -> None:
    assert read_notices(None) == [] and read_notices(tmp_path / "missing") == []
    (tmp_path / "r1-n2").write_text("terminating in 120 s")
    (tmp_path / ".tmp").write_text("")
    assert read_notices(tmp_path) == ["r1-n2"]
    assert read_notices(tmp_path) == []


def _running_job(s: Session) -> str:
    store.ensure_tenant(s, "t")
    job = store.create_job(s, tenant="t", name="j", spec={}, plan={"layout": {"tp": 1}})
    for state in ("queued", "starting", "running"):
        store.transition(s, job.id, state, reason="test")
    return job.id


def _snap(reason: str, at: int) -> dict[str, Any]:
    return {"state": "PREEMPTED", "job_state": "queued", "terminal": True, "reason": reason,
            "progress": {"step": at, "preempted_at": at}}


def test_a_preempted_job_goes_back_to_the_queue_at_its_checkpoint_and_resumes(
        db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        job_id = _running_job(s)
        mirror_state(s, store.get_job(s, job_id), _snap("preempted at step 7: node r1-n1 drains", 7))
    with store.session_scope(db_session_factory) as s:
        job = store.get_job(s, job_id)
        assert (job.state, job.step) == ("queued", 7)
        assert job.reason == "queued: preempted at step 7: node r1-n1 drains"
        [last] = store.list_events(s, job_id, types=["state"])[-1:]
        assert last.payload["preempted"]
        assert (last.payload["from"], last.payload["to"]) == ("running", "queued")
        store.transition(s, job_id, "starting", reason="test")
        note_resumed(s, job_id, job.step)
        [resumed] = store.list_events(s, job_id, types=["resumed"])
        assert resumed.payload["step"] == 7 and resumed.payload["after"] == "preemption"


def test_the_ordinary_paths_are_unchanged(db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        job_id = _running_job(s)
        with pytest.raises(IllegalTransition):  # transition() still has no running -> queued edge
            store.transition(s, job_id, "queued")
        store.transition(s, job_id, "succeeded", reason="test")
        with pytest.raises(IllegalTransition):  # and a finished job is never requeued
            store.requeue_preempted(s, job_id, step=3, reason="late notice")
        note_resumed(s, job_id, 0)  # no preemption before: no `resumed` event
        assert store.list_events(s, job_id, types=["resumed"]) == []


class FakeController:
    def __init__(self) -> None:
        self.notices: list[tuple[str, float]] = []

    def preempt(self, reason: str, grace_s: float, timeout_s: float) -> bool:
        self.notices.append((reason, grace_s))
        return True


def _attached(s: Session, name: str, node: str, gpus: int, *, priority: int = 0,
              preemption: dict[str, Any] | None = None) -> Attached:
    store.ensure_tenant(s, "t")
    job = store.create_job(s, tenant="t", name=name, spec={"preemption": preemption or {}},
                           plan={"layout": {"dp": gpus}}, priority=priority)
    for state in ("queued", "starting", "running"):
        store.transition(s, job.id, state, reason="test")
    return Attached(job.id, FakeController(), 0, {node: gpus}, JobMetrics(job.id),  # type: ignore[arg-type]
                    controller_state=ControllerState.RUNNING)


def _notices(a: Attached) -> list[tuple[str, float]]:
    return a.controller.notices  # type: ignore[attr-defined,no-any-return]


def test_a_drain_notifies_the_preemptible_jobs_on_the_node_once(
        db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        on = _attached(s, "on", "r1-n1", 2, preemption={"grace_s": 30})
        pinned = _attached(s, "pinned", "r1-n1", 2, preemption={"preemptible": False})
        off = _attached(s, "off", "r1-n2", 4)
    attached = {a.job_id: a for a in (on, pinned, off)}
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    p.drain("r1-n1", "test")
    p.tick(attached, frozenset())  # a ledger read before the cordon committed
    p.tick(attached, frozenset({"r1-n1"}))
    p.tick(attached, frozenset({"r1-n1"}))
    [(reason, grace)] = _notices(on)
    assert grace == 30.0 and "r1-n1 drains" in reason
    assert _notices(pinned) == [] and _notices(off) == []
    p.forget(on.job_id)
    p.tick(attached, frozenset())  # uncordoned: the drain is over
    p.tick(attached, frozenset({"r1-n1"}))  # a plain cordon later preempts nobody
    assert len(_notices(on)) == 1


def test_a_higher_priority_job_preempts_only_what_it_needs(db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        low = _attached(s, "low", "r1-n1", 4, priority=0)
        mid = _attached(s, "mid", "r1-n2", 4, priority=3)
        pinned = _attached(s, "pinned", "r2-n1", 4, preemption={"preemptible": False})
        busy = _attached(s, "busy", "r2-n2", 4, priority=9)
        store.ensure_tenant(s, "t")
        high = store.create_job(s, tenant="t", name="high", spec={}, plan={}, priority=5).id
        store.transition(s, high, "queued", reason="test")
    attached = {a.job_id: a for a in (low, mid, pinned, busy)}
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    full = Topology.uniform(2, 2, 4)  # Ray counts every GPU as taken: the four jobs hold them all
    full = dataclasses.replace(full, nodes=tuple(dataclasses.replace(n, gpus_free=0) for n in full.nodes))
    why = p.make_room(high, Layout(tp=4), full, attached)
    assert why is not None and low.job_id in why
    assert len(_notices(low)) == 1 and f"for job {high}" in _notices(low)[0][0]
    assert _notices(mid) == _notices(pinned) == _notices(busy) == []
    # while the victim checkpoints, nobody else is preempted
    again = p.make_room(high, Layout(tp=4), full, attached)
    assert again is not None and "waiting for preempted" in again
    assert len(_notices(low)) == 1 and _notices(mid) == []
    assert p.make_room(mid.job_id, Layout(tp=4), full, attached) is None  # not the job room is made for
    # the victim, back in the queue, lets the job it made room for start first
    assert p.held_back(low.job_id) is not None and p.held_back(mid.job_id) is None
    with store.session_scope(db_session_factory) as s:
        store.transition(s, high, "starting", reason="test")
    assert p.held_back(low.job_id) is None
    # a job that would not fit even with every lower-priority job gone preempts nobody
    p.forget(low.job_id)
    assert p.make_room(high, Layout(dp=16), full, attached) is None


def test_a_cloud_notice_cordons_and_drains_its_node(db_session_factory: sessionmaker[Session],
                                                     tmp_path: Path) -> None:
    with store.session_scope(db_session_factory) as s:
        store.upsert_node(s, "r1-n1", rack="r1", gpus=4)
        on = _attached(s, "on", "r1-n1", 2)
    (tmp_path / "r1-n1").write_text("spot instance reclaimed")
    (tmp_path / "nope").write_text("")  # an unknown node is ignored
    p = Preemptor(db_session_factory, db_session_factory, tmp_path, timeout_s=1.0)
    p.take_notices()
    with db_session_factory() as s:
        assert store.get_node(s, "r1-n1").health == "cordoned"
    p.tick({on.job_id: on}, frozenset({"r1-n1"}))
    assert len(_notices(on)) == 1 and "cloud preemption notice" in _notices(on)[0][0]
    assert list(tmp_path.iterdir()) == []


def test_a_drain_recorded_by_another_process_reaches_the_leading_scheduler(
        db_session_factory: sessionmaker[Session]) -> None:
    """An API replica (role api, no scheduler in its process) records the drain in the store; the
    leader's tick reads it and notifies the node's jobs; uncordon clears it and ends the drain."""
    with store.session_scope(db_session_factory) as s:
        store.upsert_node(s, "r1-n1", rack="r1", gpus=4)
        store.set_node_health(s, "r1-n1", NodeHealth.CORDONED)
        s.get(Node, "r1-n1").drain_reason = "drained by an admin of tenant ops"
        on = _attached(s, "on", "r1-n1", 2)
    p = Preemptor(db_session_factory, db_session_factory, None, timeout_s=1.0)
    p.take_notices()
    p.tick({on.job_id: on}, frozenset({"r1-n1"}))
    [(reason, _)] = _notices(on)
    assert "r1-n1 drains (drained by an admin of tenant ops)" in reason
    with store.session_scope(db_session_factory) as s:  # what uncordon does
        store.set_node_health(s, "r1-n1", NodeHealth.READY)
        s.get(Node, "r1-n1").drain_reason = None
    p.forget(on.job_id)
    p.take_notices()
    p.tick({on.job_id: on}, frozenset())
    p.tick({on.job_id: on}, frozenset({"r1-n1"}))  # a plain cordon later preempts nobody
    assert len(_notices(on)) == 1
