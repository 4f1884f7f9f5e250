"""The one way out of a terminal state: store.resume_job (failed|cancelled -> queued), compare-and-set."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.errors import Conflict
from service.store import ConcurrentUpdate, IllegalTransition, JobState

SPEC = {"name": "t", "train": {"steps": 16}}


def _job_in(factory: sessionmaker[Session], final: JobState) -> str:
    with store.session_scope(factory) as s:
        store.ensure_tenant(s, "a")
        job_id = store.create_job(s, tenant="a", name="t", spec=SPEC, plan=None, total_steps=16).id
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING, final):
            store.transition(s, job_id, state, reason="boom" if state == JobState.FAILED else None)
    return job_id


def test_transition_still_never_leaves_a_terminal_state(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _job_in(db_session_factory, JobState.CANCELLED)
    with store.session_scope(db_session_factory) as s, pytest.raises(IllegalTransition):
        store.transition(s, job_id, JobState.QUEUED)
    assert store.RESUME_TRANSITIONS == {JobState.FAILED: JobState.QUEUED, JobState.CANCELLED: JobState.QUEUED}


@pytest.mark.parametrize("final", [JobState.FAILED, JobState.CANCELLED])
def test_resume_job_requeues_as_a_new_attempt(
    db_session_factory: sessionmaker[Session], final: JobState
) -> None:
    job_id = _job_in(db_session_factory, final)
    with store.session_scope(db_session_factory) as s:
        version = store.get_job(s, job_id).version
        job = store.resume_job(s, job_id, expected_version=version, checkpoint_step=12, by="user of tenant a")
        assert (job.state, job.version, job.attempt, job.step) == ("queued", version + 1, 1, 12)
        assert job.finished_at is None and job.error is None
        types = [e.type for e in store.list_events(s, job_id, limit=None)][-2:]
        assert types == ["state", store.RESUME_EVENT]
    # and the ordinary machine takes it from there
    with store.session_scope(db_session_factory) as s:
        assert store.transition(s, job_id, JobState.STARTING).state == "starting"


def test_resume_job_refuses_other_states_and_stale_versions(
    db_session_factory: sessionmaker[Session],
) -> None:
    done = _job_in(db_session_factory, JobState.SUCCEEDED)
    with store.session_scope(db_session_factory) as s:
        version = store.get_job(s, done).version
        with pytest.raises(Conflict, match="is succeeded"):
            store.resume_job(s, done, expected_version=version, checkpoint_step=None, by="x")
    failed = _job_in(db_session_factory, JobState.FAILED)
    with store.session_scope(db_session_factory) as s:
        version = store.get_job(s, failed).version
        with pytest.raises(ConcurrentUpdate):
            store.resume_job(s, failed, expected_version=version - 1, checkpoint_step=None, by="x")
    with db_session_factory() as s:
        job = store.get_job(s, failed)
        assert (job.state, job.version, job.attempt) == ("failed", version, 0)
