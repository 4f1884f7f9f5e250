"""The scheduler's store-side logic without Ray: job-state mirroring along legal edges, the nodes
table kept in sync with a topology, the health ledger placement reads, controller events stored
with their side effects (SQLite and PostgreSQL, see tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler.admission import admit_pending, plan_for_live_cluster
from service.scheduler.cluster import sync_nodes
from service.scheduler.ingest import job_transition_path, store_controller_event, summarize_result
from service.settings import Settings
from service.store.jobs import LEGAL_TRANSITIONS
from service.store.models import JobState
from service.store.nodes import read_ledger
from workers.topology import Topology


@pytest.mark.parametrize(("current", "target", "path"), [
    ("queued", "running", ["starting", "running"]),
    ("starting", "succeeded", ["running", "succeeded"]),
    ("queued", "succeeded", ["starting", "running", "succeeded"]),
    ("running", "recovering", ["recovering"]),
    ("recovering", "running", ["running"]),
    ("running", "queued", ["recovering", "queued"]),  # a restart that found no capacity
    ("running", "starting", ["recovering"]),  # a restart that fell between two polls
    ("recovering", "starting", []),
    ("queued", "starting", []),  # a controller retrying placement does not flap the job
    ("starting", "starting", []),
    ("cancelled", "running", []),  # terminal states never change
    ("running", "failed", ["failed"]),
])
def test_mirrored_job_states_follow_legal_edges(current: str, target: str, path: list[str]) -> None:
    assert job_transition_path(JobState(current), JobState(target)) == [JobState(p) for p in path]


def test_every_mirrored_path_is_legal() -> None:
    reported = [s for s in JobState if s != JobState.PENDING]  # the states a controller reports
    for current, target in itertools.product(JobState, reported):
        state = current
        for nxt in job_transition_path(current, target):
            assert nxt in LEGAL_TRANSITIONS[state], (current, target)
            state = nxt


def test_result_summary_keeps_digest_losses_and_last_checkpoint() -> None:
    result = {"model_digest": "abc", "final_step": 6, "losses": [3.0, 2.0, 1.5], "resumed_from": 3,
              "checkpoints": [{"step": 4}, {"step": 6}], "restarts": 0, "layout": {"tp": 2}}
    out = summarize_result(result, {"tokens_per_s": 100.0, "step_time_s": 0.5})
    firsts = (out["model_digest"], out["loss_first"], out["loss_first_step"], out["loss_last"])
    assert firsts == ("abc", 3.0, 4, 1.5)
    assert out["checkpoint"] == {"step": 6} and out["losses"] == [3.0, 2.0, 1.5]


def _job(factory: sessionmaker[Session]) -> str:
    with store.session_scope(factory) as s:
        store.ensure_tenant(s, "t")
        return store.create_job(s, tenant="t", name="j", spec={"fault_tolerance": {"sdc_check_every": 2}},
                                plan={"layout": {"tp": 1}}).id


def test_nodes_table_follows_the_live_cluster(db_session_factory: sessionmaker[Session]) -> None:
    topo = Topology.uniform(2, 2, 4)
    with store.session_scope(db_session_factory) as s:
        assert len(sync_nodes(s, topo)) == 4
        assert sync_nodes(s, topo) == []  # nothing to write when nothing changed
        store.set_node_health(s, "r1-n2", "quarantined")
        store.set_node_health(s, "r2-n1", "cordoned")
    gone = dataclasses.replace(topo, nodes=tuple(
        dataclasses.replace(n, alive=False) if n.name in ("r1-n1", "r1-n2") else n
        for n in topo.nodes if n.name != "r2-n2"))
    with store.session_scope(db_session_factory) as s:
        sync_nodes(s, gone)
        health = {n.id: n.health for n in store.list_nodes(s)}
    # dead when Ray says so or when missing; quarantine and cordon survive a node's death
    assert health == {"r1-n1": "dead", "r1-n2": "quarantined", "r2-n1": "cordoned", "r2-n2": "dead"}
    with store.session_scope(db_session_factory) as s:
        store.set_node_health(s, "r2-n2", "dead", fault="kill_node")
        sync_nodes(s, topo)  # everything is back
        health = {n.id: n.health for n in store.list_nodes(s)}
        ledger = read_ledger(s)
    assert health == {"r1-n1": "ready", "r1-n2": "quarantined", "r2-n1": "cordoned", "r2-n2": "suspect"}
    assert ledger.cordoned == {"r2-n1"} and ledger.health["r2-n1"] == "ready"
    placeable = topo.with_health(ledger.health, ledger.cordoned).schedulable_nodes()
    assert [n.name for n in placeable] == ["r1-n1", "r2-n2"]


def test_controller_events_are_stored_with_side_effects(db_session_factory: sessionmaker[Session]) -> None:
    job_id = _job(db_session_factory)
    events = [
        {"seq": 1, "kind": "state", "ts": 1.0, "message": "INIT -> PLACING", "state": "INIT"},
        {"seq": 2, "kind": "checkpoint_saved", "ts": 2.0, "step": 2, "path": "/c/2", "bytes": 10},
        {"seq": 3, "kind": "checkpoint_saved", "ts": 3.0, "step": 3, "path": "/c/3", "bytes": 10},
        {"seq": 4, "kind": "node_suspect", "ts": 4.0, "message": "node r1-n1 is suspect", "node": "r1-n1"},
        {"seq": 5, "kind": "replanned", "ts": 5.0, "message": "fewer GPUs", "new_layout": {"tp": 2},
         "old_layout": {"tp": 1}},
    ]
    with store.session_scope(db_session_factory) as s:
        job = store.get_job(s, job_id)
        for e in events:
            store_controller_event(s, job, e)
    with store.session_scope(db_session_factory) as s:
        stored = store.list_events(s, job_id, limit=None)
        ckpts = [(c.step, c.path, c.verified) for c in store.list_checkpoints(s, job_id)]
        node = store.get_node(s, "r1-n1")
        plan = store.get_job(s, job_id).plan
    types = [e.type for e in stored]
    assert types == [
        "created", "controller_state", "checkpoint", "checkpoint", "node_suspect", "plan", "replanned",
    ]
    assert stored[1].payload["cseq"] == 1 and stored[4].payload["cseq"] == 4
    assert ckpts == [(2, "/c/2", True), (3, "/c/3", False)]  # verified: integrity checked at step 2, not 3
    assert (node.health, node.fault_count) == ("suspect", 1)
    # the layout planned first is kept: an elastic job grows back to it (workers.controller.elastic)
    assert plan == {"layout": {"tp": 2}, "replanned_from": {"tp": 1}, "planned_layout": {"tp": 1}}


def test_a_plan_for_another_gpu_type_is_redone_for_the_live_cluster(
    db_session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    from service.api.operations import plan_job
    from service.schemas import JobSpec

    settings = Settings(home=tmp_path, gpu_type="cpu-virtual")
    spec = JobSpec.model_validate({
        "name": "h100", "model": {"preset": "demo"}, "train": {"steps": 2, "global_batch": 8},
        "resources": {"gpus": 8, "gpu_type": "H100"},
    })
    with store.session_scope(db_session_factory) as s:
        store.ensure_tenant(s, "t")
        planned = plan_job(spec, settings)
        job = store.create_job(s, tenant="t", name="h100", spec=spec.canonical(), plan=planned)
        assert job.plan["cluster"]["gpu_type"] != "cpu-virtual"
    admit_pending(db_session_factory, db_session_factory, settings, Topology.uniform(2, 2, 4))
    with db_session_factory() as s:
        job = store.get_job(s, job.id)
        plan, state, events = job.plan, job.state, [e.type for e in store.list_events(s, job.id)]
    assert state == "queued" and events.count("plan") == 1
    assert plan["cluster"] == {"gpu_type": "cpu-virtual", "num_gpus": 8}
    assert (plan["layout"]["tp"], plan["layout"]["pp"], plan["layout"]["dp"]) == (2, 2, 2)
    same = plan_for_live_cluster(spec.canonical(), plan, settings, Topology.uniform(2, 2, 4))
    assert same == (None, None)  # planned for the live type: left alone
