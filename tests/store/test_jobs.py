"""The job state machine, event log and progress against SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.store import ConcurrentUpdate, IllegalTransition, JobState
from service.store.models import Job

SPEC = {"name": "t", "train": {"steps": 10}}


def _new_job(factory: sessionmaker[Session], tenant: str = "a", **kwargs: object) -> str:
    with store.session_scope(factory) as s:
        store.ensure_tenant(s, tenant)
        job = store.create_job(s, tenant=tenant, name="t", spec=SPEC, plan=None, total_steps=10, **kwargs)
        return job.id


def _force_state(factory: sessionmaker[Session], job_id: str, state: JobState) -> None:
    """Test setup only: put a job into a state without going through the machine."""
    with store.session_scope(factory) as s:
        s.execute(update(Job).where(Job.id == job_id).values(state=state.value))


def test_create_job_is_pending_with_created_event(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        assert (job.state, job.version, job.attempt, job.total_steps) == ("pending", 0, 0, 10)
        assert job.created_at.tzinfo is not None
        events = store.list_events(s, job_id)
        assert [(e.seq, e.type, e.payload["state"]) for e in events] == [(1, "created", "pending")]


def test_happy_path_bumps_version_and_logs_each_state(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    path = [
        JobState.QUEUED,
        JobState.STARTING,
        JobState.RUNNING,
        JobState.RECOVERING,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ]
    for i, state in enumerate(path):
        with store.session_scope(db_session_factory) as s:
            job = store.transition(s, job_id, state, expected_version=i, reason=f"step {i}")
            assert (job.state, job.version) == (state.value, i + 1)
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        assert job.started_at is not None and job.finished_at is not None
        assert job.finished_at >= job.started_at
        states = [e.payload for e in store.list_events(s, job_id, types=["state"])]
        assert [(p["from"], p["to"]) for p in states] == list(
            zip(["pending"] + [s.value for s in path[:-1]], [s.value for s in path], strict=True)
        )
        assert [e.seq for e in store.list_events(s, job_id)] == list(range(1, len(path) + 2))


def test_every_illegal_transition_is_refused(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    refused = 0
    for source in JobState:
        for target in JobState:
            if target in store.LEGAL_TRANSITIONS[source]:
                continue
            _force_state(db_session_factory, job_id, source)
            with db_session_factory() as s:
                before = store.get_job(s, job_id).version
                with pytest.raises(IllegalTransition) as info:
                    store.transition(s, job_id, target)
                s.rollback()
                assert f"from {source.value!r} to {target.value!r}" in str(info.value)
                assert store.get_job(s, job_id).version == before
            refused += 1
    # 8 states x 8 targets minus the 19 legal moves.
    assert refused == 64 - sum(len(v) for v in store.LEGAL_TRANSITIONS.values()) == 45


@pytest.mark.parametrize("terminal", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_terminal_states_never_change(db_session_factory: sessionmaker[Session], terminal: JobState) -> None:
    job_id = _new_job(db_session_factory)
    _force_state(db_session_factory, job_id, terminal)
    for target in JobState:
        with db_session_factory() as s, pytest.raises(IllegalTransition, match="terminal"):
            store.transition(s, job_id, target)
    with db_session_factory() as s:
        assert store.get_job(s, job_id).state == terminal.value
        store.update_progress(s, job_id, step=5, loss=1.0)  # ignored: a finished job keeps its final progress
        s.commit()
        assert store.get_job(s, job_id).step == 0


def test_stale_expected_version_is_a_concurrent_update(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with db_session_factory() as s:
        seen = store.get_job(s, job_id).version
    with store.session_scope(db_session_factory) as s:
        store.transition(s, job_id, JobState.QUEUED, expected_version=seen)
    with db_session_factory() as s, pytest.raises(ConcurrentUpdate, match="expected version 0, found 1"):
        store.transition(s, job_id, JobState.CANCELLED, expected_version=seen)


def test_racing_transitions_exactly_one_wins(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with store.session_scope(db_session_factory) as s:
        store.transition(s, job_id, JobState.QUEUED)
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def attempt() -> None:
        with db_session_factory() as s:
            barrier.wait()
            try:
                store.transition(s, job_id, JobState.STARTING)
                s.commit()
                outcomes.append("won")
            except (ConcurrentUpdate, IllegalTransition) as e:
                s.rollback()
                outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("won") == 1, outcomes
    assert len(outcomes) == 8
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        assert (job.state, job.version) == ("starting", 2)
        assert len(store.list_events(s, job_id, types=["state"])) == 2


def test_unknown_state_names_the_allowed_ones(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with db_session_factory() as s, pytest.raises(ValueError, match="state must be one of pending, queued"):
        store.transition(s, job_id, "done")


def test_transition_sets_fields_atomically(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with store.session_scope(db_session_factory) as s:
        store.transition(s, job_id, JobState.QUEUED)
        store.transition(s, job_id, JobState.FAILED, reason="out of restarts", set_fields={"attempt": 3})
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        assert (job.state, job.attempt, job.error) == ("failed", 3, "out of restarts")
        with pytest.raises(ValueError, match="cannot set"):
            store.transition(s, job_id, JobState.QUEUED, set_fields={"state": "running"})


def test_progress_does_not_bump_version(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with store.session_scope(db_session_factory) as s:
        store.update_progress(s, job_id, step=4, loss=2.5, tokens_per_s=1000.0, mfu=0.1)
    with db_session_factory() as s:
        job = store.get_job(s, job_id)
        assert (job.step, job.loss, job.tokens_per_s, job.mfu, job.version) == (4, 2.5, 1000.0, 0.1, 0)
        with pytest.raises(ValueError, match="cannot set"):
            store.update_progress(s, job_id, version=9)
        with pytest.raises(store.JobNotFound):
            store.update_progress(s, "nope", step=1)


def test_events_append_in_order_and_page(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with store.session_scope(db_session_factory) as s:
        for i in range(5):
            store.append_event(s, job_id, "progress", {"step": i})
    with db_session_factory() as s:
        page = store.list_events(s, job_id, after_seq=2, limit=2)
        assert [(e.seq, e.payload.get("step")) for e in page] == [(3, 1), (4, 2)]
        with pytest.raises(store.JobNotFound):
            store.append_event(s, "missing", "x", {})


def test_list_jobs_filters_pages_and_queue_order(db_session_factory: sessionmaker[Session]) -> None:
    ids = [_new_job(db_session_factory, tenant="a" if i % 2 else "b", priority=i % 3) for i in range(6)]
    with store.session_scope(db_session_factory) as s:
        store.transition(s, ids[0], JobState.QUEUED)
    with db_session_factory() as s:
        newest = [j.id for j in store.list_jobs(s, limit=None)]
        assert newest == sorted(ids, reverse=True)
        assert [j.id for j in store.list_jobs(s, tenant="a", limit=None)] == sorted(ids[1::2], reverse=True)
        assert [j.id for j in store.list_jobs(s, states=["queued"])] == [ids[0]]
        page1 = store.list_jobs(s, limit=4)
        page2 = store.list_jobs(s, limit=4, after_id=page1[-1].id)
        assert [j.id for j in page1 + page2] == newest
        queue = store.list_jobs(s, states=["pending", "queued"], order="queue", limit=None)
        assert [(j.priority, j.id) for j in queue] == sorted(
            ((j.priority, j.id) for j in queue), key=lambda t: (-t[0], t[1])
        )
        counts = store.count_jobs_by_state(s)
        assert counts[JobState.PENDING] == 5 and counts[JobState.QUEUED] == 1


def test_checkpoints_latest_verified(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(db_session_factory)
    with store.session_scope(db_session_factory) as s:
        store.record_checkpoint(s, job_id, 10, "/c/10", verified=True, manifest_digest="d10", bytes=100)
        store.record_checkpoint(s, job_id, 20, "/c/20", verified=False, bytes=100)
    with store.session_scope(db_session_factory) as s:
        assert store.latest_checkpoint(s, job_id).step == 10
        assert store.latest_checkpoint(s, job_id, verified_only=False).step == 20
        store.mark_checkpoint_verified(s, job_id, 20)
    with db_session_factory() as s:
        assert store.latest_checkpoint(s, job_id).path == "/c/20"
        assert [c.step for c in store.list_checkpoints(s, job_id)] == [10, 20]
        assert [e.payload["step"] for e in store.list_events(s, job_id, types=["checkpoint"])] == [10, 20]


def test_nodes_health_and_fault_counts(db_session_factory: sessionmaker[Session]) -> None:
    with store.session_scope(db_session_factory) as s:
        store.upsert_node(s, "n1", hostname="h1", rack="r0", gpus=4)
        store.upsert_node(s, "n2", hostname="h2", rack="r1", gpus=4)
    with store.session_scope(db_session_factory) as s:
        node = store.set_node_health(s, "n1", "suspect", fault="rank 3 heartbeat timeout")
        store.set_node_health(s, "n1", "quarantined", fault="sdc")
    with db_session_factory() as s:
        node = store.get_node(s, "n1")
        assert (node.health, node.fault_count, node.last_fault) == ("quarantined", 2, "sdc")
        assert [n.id for n in store.list_nodes(s, health="ready")] == ["n2"]
        store.upsert_node(s, "n1", hostname="h1", rack="r0", gpus=8)  # inventory refresh keeps the health
        assert (store.get_node(s, "n1").health, store.get_node(s, "n1").gpus) == ("quarantined", 8)
        with pytest.raises(ValueError, match="health must be one of ready, suspect"):
            store.set_node_health(s, "n2", "sick")
