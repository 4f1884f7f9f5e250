"""Every failure is classified before the controller acts on it (workers.controller.classify), one
transition at a time against the dummy worker group: a job error fails the job at once and blames
no node; an unknown failure restarts blaming nobody and becomes a job error when it recurs; an
infrastructure fault restarts and counts against its node; the crash-loop breaker; and the node
ledger across jobs in the store."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler.ingest import store_controller_event
from service.store.models import Tenant
from workers.controller import classify
from workers.controller.options import ControllerOptions
from workers.controller.state import ControllerState
from workers.policies import Failure, FailureAction, FailureClass, FailureKind, RestartPolicy
from workers.topology import Topology

from .dummy import running, step_events
from .test_state_machine import drive, kinds, to_running

S = ControllerState
WORLD = 4


def failed_event(rank: int, error: str, types: list[str], origin: str | None = None, step: int = 2) -> dict:
    """A rank's `failed` report as workers.rank.exception_report makes it."""
    return {"kind": "failed", "rank": rank, "error": error, "error_types": types, "origin": origin,
            "step": step, "traceback": f'Traceback (most recent call last):\n  File "x.py"\n{error}\n'}


def fail_ranks(wg: Any, reports: dict[int, dict]) -> None:
    errors = {r: e["error"] for r, e in reports.items()}
    wg.push(running(WORLD, state={r: "failed" for r in reports}, error=errors,
                    events={r: [e] for r, e in reports.items()}))


def event(sm: Any, kind: str) -> dict:
    return [e for e in sm.events if e["kind"] == kind][-1]


def assert_nobody_blamed(sm: Any) -> None:
    assert not {"node_suspect", "node_quarantined", "attributed"} & set(kinds(sm))
    assert sm.attributor.nodes.faults == {} and sm.suspect_nodes == [] and sm.quarantined_nodes == []


DATA_ERROR = "DataError: data.path tokens.bin holds a token id >= model.vocab (64)"


def test_a_data_error_fails_the_job_at_once_with_the_traceback_and_blames_no_node():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=5))
    fail_ranks(wg, {0: failed_event(0, DATA_ERROR, ["DataError", "ValueError", "Exception"],
                                    "/repo/training/data/sources.py")})
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.ERRORED)
    assert sm.restarts == 0 and wg.starts and len(wg.starts) == 1  # no restart spent
    assert sm.reason == f"job error: {DATA_ERROR} (rank 0, after step 2)"
    failure = event(sm, "failure")
    assert failure["classification"] == "job_error" and failure["failure"]["classification"] == "job_error"
    assert DATA_ERROR in failure["traceback"]
    assert event(sm, "job_error")["message"] == sm.reason
    assert DATA_ERROR in event(sm, "error")["traceback"]
    snap = sm.snapshot()
    assert snap["job_state"] == "failed" and DATA_ERROR in snap["traceback"]
    assert_nobody_blamed(sm)


def test_a_value_error_from_the_configuration_is_a_job_error_but_not_from_elsewhere():
    sm, wg, _ = to_running()
    fail_ranks(wg, {1: failed_event(1, "ValueError: tp (3) must divide heads", ["ValueError", "Exception"],
                                    "/repo/training/config/layout.py")})
    assert sm.step().to_state == S.ERRORED and sm.reason.startswith("job error: ValueError: tp (3)")
    sm, wg, _ = to_running()
    fail_ranks(wg, {1: failed_event(1, "ValueError: boom", ["ValueError", "Exception"], "/repo/my_train.py")})
    assert sm.step().to_state == S.RECOVERING  # unknown: once is not yet the job's


def test_an_unknown_error_restarts_blaming_nobody_then_recurring_identically_is_a_job_error():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=5))
    boom = failed_event(2, "KeyError: 'w_out'", ["KeyError", "LookupError", "Exception"], "/repo/my_train.py")
    fail_ranks(wg, {2: boom})
    t = sm.step()
    assert t.to_state == S.RECOVERING and "unknown cause: no node blamed" in t.reason
    assert event(sm, "failure")["classification"] == "unknown"
    assert_nobody_blamed(sm)
    drive(sm, S.RUNNING)
    assert sm.restarts == 1 and wg.seen_health == {}  # the restart marks no node
    fail_ranks(wg, {2: boom})
    t = sm.step()
    assert t.to_state == S.ERRORED and sm.restarts == 1
    assert sm.reason == "job error, reproduced on the re-run: KeyError: 'w_out' (rank 2, after step 2)"
    assert_nobody_blamed(sm)


def test_a_different_error_on_the_retry_is_still_unknown():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=5))
    fail_ranks(wg, {2: failed_event(2, "KeyError: 'a'", ["KeyError", "Exception"])})
    sm.step()
    drive(sm, S.RUNNING)
    wg.push(running(WORLD, events=step_events(WORLD, 3, 2.0)))  # progress in between
    sm.step()
    fail_ranks(wg, {2: failed_event(2, "KeyError: 'b'", ["KeyError", "Exception"])})
    assert sm.step().to_state == S.RECOVERING


def test_the_same_exception_on_every_rank_is_a_job_error():
    sm, wg, _ = to_running()
    fail_ranks(wg, {r: failed_event(r, "RuntimeError: shape mismatch", ["RuntimeError", "Exception"])
                    for r in range(WORLD)})
    assert sm.step().to_state == S.ERRORED
    assert sm.reason.startswith("job error, raised on every rank: RuntimeError: shape mismatch")
    assert_nobody_blamed(sm)


PEER_CLOSED = "RuntimeError: [gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:8105"
GRACE_S = ControllerOptions().failure_grace_s


def test_a_collective_error_is_infrastructure_and_counts_against_the_node():
    sm, wg, clock = to_running()
    node = wg.reserved.ranks[1].node_name
    fail_ranks(wg, {1: failed_event(1, PEER_CLOSED, ["RuntimeError", "Exception"])})
    assert sm.step() is None  # its peer may yet show up dead: the grace period first
    clock.advance(GRACE_S + 0.1)
    wg.push(running(WORLD, state={1: "failed"}, error={1: PEER_CLOSED}))  # nobody else is gone
    assert sm.step().to_state == S.RECOVERING
    assert event(sm, "failure")["classification"] == "infrastructure"
    assert sm.suspect_nodes == [node] and "node_suspect" in kinds(sm)


def test_survivors_whose_collective_broke_are_not_blamed_for_the_peer_that_died():
    """A lost peer's survivors fail in their collective before its death shows in a poll (a node's
    takes a health check): the dead ranks are blamed, the survivors' node is not."""
    sm, wg, clock = to_running(topology=Topology.uniform(2, 2, 2))  # a TP pair per node
    survivors = {r: failed_event(r, PEER_CLOSED, ["RuntimeError", "Exception"]) for r in (0, 1)}
    fail_ranks(wg, survivors)  # ranks 2 and 3 still look alive: their node's death is not known yet
    assert sm.step() is None
    clock.advance(1.0)
    wg.push(running(WORLD, state={0: "failed", 1: "failed", 2: "dead", 3: "dead"},
                    error={0: PEER_CLOSED, 1: PEER_CLOSED, 2: "ActorDiedError", 3: "ActorDiedError"}))
    assert sm.step().to_state == S.RECOVERING
    failure = event(sm, "failure")["failure"]
    assert failure["kind"] == "rank_died" and failure["ranks"] == [2, 3]
    survivors_node, dead_node = (wg.reserved.ranks[r].node_name for r in (0, 2))
    assert survivors_node != dead_node and sm.suspect_nodes == [dead_node]


def test_the_rank_with_its_own_error_is_blamed_not_the_peers_whose_collective_it_broke():
    sm, wg, _ = to_running(topology=Topology.uniform(2, 2, 2))
    fail_ranks(wg, {0: failed_event(0, PEER_CLOSED, ["RuntimeError", "Exception"]),
                    2: failed_event(2, "RuntimeError: CUDA error: an illegal memory access",
                                    ["RuntimeError", "Exception"])})
    assert sm.step().to_state == S.RECOVERING
    failure = event(sm, "failure")["failure"]
    assert failure["kind"] == "rank_error" and failure["ranks"] == [2]
    assert wg.reserved.ranks[0].node_name != wg.reserved.ranks[2].node_name
    assert sm.suspect_nodes == [wg.reserved.ranks[2].node_name]


def test_a_dead_rank_restarts_and_its_node_becomes_suspect_never_quarantined_by_one_job():
    sm, wg, _ = to_running(topology=Topology.uniform(1, 1, 4), failure_policy=RestartPolicy(max_restarts=10),
                           options=ControllerOptions(crash_loop_attempts=0))
    node = wg.reserved.ranks[1].node_name
    for _ in range(5):  # more than quarantine_after (3) faults, all from this one job
        wg.push(running(WORLD, state={1: "dead"}))
        assert sm.step().to_state == S.RECOVERING
        drive(sm, S.RUNNING)
    assert event(sm, "failure")["classification"] == "infrastructure"
    assert sm.attributor.nodes.faults[node] == 5 and sm.restarts == 5
    assert sm.suspect_nodes == [node] and sm.quarantined_nodes == []  # one job never quarantines
    assert node in sm.attributor.exclude  # but this job keeps off it when it can


def _integrity(step: int, ranks: list[int], **evidence: Any) -> dict[int, list[dict]]:
    err = {"kind": "integrity_error", "error_kind": "nonfinite", "step": step, "ranks": ranks,
           "evidence": {"attribution": "rerun from the pre-step snapshot", **evidence},
           "message": f"nonfinite at step {step}"}
    return {r: [dict(err, rank=r)] for r in range(WORLD)}


def test_a_nonfinite_loss_reproduced_on_the_re_run_is_diverged_and_blames_nobody():
    sm, wg, _ = to_running()
    events = _integrity(3, list(range(WORLD)), transient=False,
                        diverged={"what": "loss", "value": "nan", "step": 3})
    wg.push(running(WORLD, state={r: "failed" for r in range(WORLD)}, events=events))
    assert sm.step().to_state == S.ERRORED
    assert sm.reason == "diverged, reproduced: loss is nan at step 3 on re-run"
    assert sm.restarts == 0 and "referee_started" not in kinds(sm)
    assert_nobody_blamed(sm)


def test_a_nonfinite_loss_on_every_rank_without_a_re_run_restarts_then_recurs_as_diverged():
    sm, wg, _ = to_running()
    events = _integrity(3, list(range(WORLD)))
    wg.push(running(WORLD, state={r: "failed" for r in range(WORLD)}, events=events))
    assert sm.step().to_state == S.RECOVERING  # the restart from the checkpoint is the re-run
    assert event(sm, "failure")["classification"] == "unknown"
    drive(sm, S.RUNNING)
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events=_integrity(3, list(range(WORLD)))))
    assert sm.step().to_state == S.ERRORED
    assert sm.reason.startswith("diverged, reproduced: nonfinite at step 3 on re-run")
    assert_nobody_blamed(sm)


def test_a_nonfinite_gradient_on_one_rank_is_infrastructure():
    sm, wg, _ = to_running()
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events=_integrity(3, [2], transient=True)))
    assert sm.step().to_state == S.RECOVERING
    assert event(sm, "failure")["classification"] == "infrastructure"
    assert wg.reserved.ranks[2].node_name in sm.quarantined_nodes  # a confirmed SDC: at once


def test_the_same_sdc_at_the_same_step_after_the_restart_follows_the_job_not_a_node():
    """A singled-out SDC quarantines its node; the same check at the same step again on the
    restarted ranks (kept off that node) is the job's: it fails, and no second node is blamed."""
    sm, wg, _ = to_running()
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events=_integrity(3, [2], transient=False)))
    assert sm.step().to_state == S.RECOVERING
    first = wg.reserved.ranks[2].node_name
    assert sm.quarantined_nodes == [first]
    drive(sm, S.RUNNING)
    wg.push(running(WORLD, state=everyone, events=_integrity(3, [2], transient=False)))
    assert sm.step().to_state == S.ERRORED
    assert sm.reason == ("nonfinite at step 3 again after the restart, on other hardware: "
                         "the job's, not a node's")
    assert sm.quarantined_nodes == [first]


@pytest.mark.parametrize("kind", ["grad_norm_spike", "grad_norm_outlier"])
def test_a_gradient_spike_no_re_run_confirmed_blames_nobody_and_recurring_is_the_jobs(kind):
    """No pre-step snapshot (ZeRO-1, DP 3): a local gradient norm far above its own history or its
    peers' is only a statistic, which the data can produce; the restart re-runs it, and the same
    spike again (not to the bit: the ranks settle that one) is the job's, on no node."""
    sm, wg, _ = to_running()
    spike = {"kind": "integrity_error", "error_kind": kind, "step": 295, "ranks": [0],
             "evidence": {"grad_norm": 17.1, "reference": 1.06, "factor": 10.0,
                          "grad_norms_local": {"0": 17.1}}, "message": "spike"}
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events={r: [dict(spike, rank=r)] for r in range(WORLD)}))
    assert sm.step().to_state == S.RECOVERING
    assert event(sm, "failure")["classification"] == "unknown"
    assert_nobody_blamed(sm)
    drive(sm, S.RUNNING)
    # The restart is the re-run: the ranks get the spike to compare theirs with (the same, to the
    # bit, is the data's and they go on: tests/training/test_gradient_spike.py).
    assert wg.starts[-1]["rerun_spikes"] == {295: {0: 17.1}}
    wg.push(running(WORLD, state=everyone, events={r: [dict(spike, rank=r)] for r in range(WORLD)}))
    assert sm.step().to_state == S.ERRORED
    assert sm.reason.startswith(f"{kind} at step 295 again after the restart")
    assert_nobody_blamed(sm)


def test_a_spike_the_restart_reproduced_only_on_the_same_device_is_a_persistent_fault():
    """The restart (nobody blamed, the same nodes) re-ran the spike; the ranks' swap probe computed
    rank 2's batch on its DP peer's device and got another norm: the spike follows the device, not
    the data. Not the job's (though it recurred): rank 2's node is quarantined and the job restarts."""
    sm, wg, _ = to_running()
    node = sm.attempt.rank_node[2]
    spike = {"kind": "integrity_error", "error_kind": "grad_norm_outlier", "step": 7, "ranks": [2],
             "evidence": {"grad_norms_local": {"2": 4.05e4}}, "message": "outlier"}
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events={r: [dict(spike, rank=r)] for r in range(WORLD)}))
    assert sm.step().to_state == S.RECOVERING
    assert_nobody_blamed(sm)
    drive(sm, S.RUNNING)
    settled = dict(spike, evidence={**spike["evidence"], "local_reproduced": True, "transient": False,
                                    "attribution": "the restart re-ran it; the batch on a DP peer's device "
                                    "gave another norm", "swap": {"follows_data": False, "norms": {
                                        "2": {"own": 4.05e4, "peer": 3.9}}}})
    wg.push(running(WORLD, state=everyone, events={r: [dict(settled, rank=r)] for r in range(WORLD)}))
    assert sm.step().to_state == S.RECOVERING
    failure = event(sm, "failure")
    assert failure["classification"] == "infrastructure" and "persistent" in failure["classification_reason"]
    assert sm.quarantined_nodes == [node], failure


@pytest.mark.parametrize("changed", [False, True], ids=["same-norms", "changed-norms"])
def test_a_restarts_re_run_of_a_spike_blames_the_first_nodes_only_when_the_norms_changed(changed):
    """The restart re-ran the spike's step and no check fired: the same norms are the data's (logged,
    nobody blamed); changed norms mean the first attempt's were corrupt: a transient fault of the
    node rank 2 was on *then*, counted against it now (suspect), and the job runs on."""
    sm, wg, _ = to_running()
    node = sm.attempt.rank_node[2]
    spike = {"kind": "integrity_error", "error_kind": "grad_norm_outlier", "step": 7, "ranks": [2],
             "evidence": {"grad_norms_local": {"2": 40.5}}, "message": "outlier"}
    everyone = {r: "failed" for r in range(WORLD)}
    wg.push(running(WORLD, state=everyone, events={r: [dict(spike, rank=r)] for r in range(WORLD)}))
    assert sm.step().to_state == S.RECOVERING
    drive(sm, S.RUNNING)
    assert wg.starts[-1]["rerun_spikes"] == {7: {2: 40.5}}
    same, other = ([], [2]) if changed else ([2], [])
    rerun = {"kind": "gradient_rerun", "step": 7, "same": same, "changed": other}
    wg.push(running(WORLD, events={r: [dict(rerun, rank=r)] for r in range(WORLD)}))
    assert sm.step() is None and sm.state == S.RUNNING
    logged = event(sm, "gradient_rerun")
    assert logged["step"] == 7 and len([e for e in sm.events if e["kind"] == "gradient_rerun"]) == 1
    if not changed:
        assert "the data's" in logged["message"]
        assert_nobody_blamed(sm)
        return
    assert "transient fault" in logged["message"]
    blamed = event(sm, "attributed")
    assert blamed["ranks"] == [2] and blamed["nodes"] == [node] and blamed["transient"] is True
    assert sm.suspect_nodes == [node] and sm.quarantined_nodes == []


def test_a_gradient_spike_the_ranks_settled_as_the_datas_is_logged_and_the_job_runs_on():
    sm, wg, _ = to_running()
    spike = {"kind": "gradient_spike", "error_kind": "grad_norm_spike", "step": 295, "ranks": [0],
             "evidence": {"local_reproduced": True}}
    wg.push(running(WORLD, events={r: [dict(spike, rank=r)] for r in range(WORLD)}))
    assert sm.step() is None and sm.state == S.RUNNING
    logged = [e for e in sm.events if e["kind"] == "gradient_spike"]
    assert len(logged) == 1 and logged[0]["step"] == 295 and logged[0]["ranks"] == [0]
    assert "the data's, not the hardware's" in logged[0]["message"]
    assert_nobody_blamed(sm)


def test_the_crash_loop_breaker_fails_a_job_without_progress_in_n_attempts():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=10),
                           options=ControllerOptions(crash_loop_attempts=3))
    for attempt in (1, 2):
        wg.push(running(WORLD, state={0: "dead"}))
        assert sm.step().to_state == S.RECOVERING, attempt
        drive(sm, S.RUNNING)
    wg.push(running(WORLD, state={0: "dead"}))
    assert sm.step().to_state == S.ERRORED
    assert sm.reason.startswith("crash loop: no progress in 3 consecutive attempts")
    assert sm.restarts == 2 and event(sm, "failure")["attempts_without_progress"] == 3


def test_the_crash_loop_breaker_lets_a_job_that_progresses_go_on():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=10),
                           options=ControllerOptions(crash_loop_attempts=2))
    for step in (1, 2, 3, 4):
        wg.push(running(WORLD, events=step_events(WORLD, step, 3.0)))
        sm.step()  # running (or checkpointing) after a new completed step
        wg.push(running(WORLD, state={0: "dead"}))
        assert sm.step().to_state == S.RECOVERING, step
        drive(sm, S.RUNNING)
    assert sm.restarts == 4


def test_the_policy_decides_on_the_class():
    policy = RestartPolicy(max_restarts=3)
    job = Failure(FailureKind.RANK_ERROR, "x", (0,), ("n1",), classification=FailureClass.JOB_ERROR,
                  why="job error: DataError: x")
    assert policy.decide(job, 0) == policy.decide(job, 0)
    decision = policy.decide(job, 0)
    assert (decision.action, decision.reason, decision.suspect_nodes) == (FailureAction.RAISE,
                                                                         "job error: DataError: x", ())
    unknown = Failure(FailureKind.RANK_ERROR, "x", (0,), ("n1",))  # a rank error is unknown by default
    decision = policy.decide(unknown, 0)
    assert decision.action == FailureAction.RETRY and decision.suspect_nodes == decision.exclude_nodes == ()
    assert policy.decide(unknown, 3).action == FailureAction.RAISE  # within the budget only
    infra = Failure(FailureKind.RANK_ERROR, "x", (0,), ("n1",), classification=FailureClass.INFRASTRUCTURE)
    assert policy.decide(infra, 0).suspect_nodes == ("n1",)


# ---- the node ledger across jobs, in the store ---------------------------------------------------------


def _suspect(job_id: str, node: str = "n1") -> dict:
    return {"seq": 1, "kind": "node_suspect", "ts": 1.0, "message": f"node {node} is suspect", "node": node}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_faults_from_one_job_never_quarantine_a_node_two_jobs_do(db_session_factory: sessionmaker[Session]):
    with store.session_scope(db_session_factory) as s:
        s.add(Tenant(name="t"))
        s.flush()
        store.upsert_node(s, "n1", gpus=4)
        jobs = [store.create_job(s, tenant="t", name=f"j{i}", spec={}, plan=None, total_steps=4)
                for i in range(2)]
    with store.session_scope(db_session_factory) as s:
        for _ in range(5):  # the same job's suspect events, as many controllers of it would send
            store_controller_event(s, store.get_job(s, jobs[0].id), _suspect(jobs[0].id))
    with db_session_factory() as s:
        node = store.get_node(s, "n1")
        assert (node.health, node.fault_count, node.fault_jobs) == ("suspect", 5, [jobs[0].id])
    with store.session_scope(db_session_factory) as s:
        store_controller_event(s, store.get_job(s, jobs[1].id), _suspect(jobs[1].id))
    with store.session_scope(db_session_factory) as s:
        node = store.get_node(s, "n1")
        assert node.health == "quarantined" and node.fault_jobs == [jobs[0].id, jobs[1].id]
        assert "faults from 2 jobs" in node.last_fault
        store.set_node_health(s, "n1", "ready")  # an operator's "ready" starts the ledger afresh
    with db_session_factory() as s:
        assert store.get_node(s, "n1").fault_jobs is None


# ---- the evidence: the rank's exception report and the engine's re-run verdict ------------------------


def test_a_rank_reports_its_exception_with_types_origin_and_a_bounded_traceback():
    from training.data.sources import DataError
    from workers.rank import MAX_TRACEBACK_CHARS, exception_report

    message = "data.path bad.bin holds a token id >= model.vocab (64)"
    try:
        raise DataError(message)
    except DataError as e:
        report = exception_report(e, 3)
    assert report["error"] == f"DataError: {message}"
    assert report["error_types"][:2] == ["DataError", "ValueError"] and report["step"] == 3
    assert report["origin"] == __file__ and report["traceback"].endswith(f"DataError: {message}\n")
    assert report["traceback"].startswith("Traceback (most recent call last)")
    try:
        raise RuntimeError("x" * 20_000 + " the end")  # far longer than the bound
    except RuntimeError as e:
        report = exception_report(e, None)
    assert len(report["traceback"]) == MAX_TRACEBACK_CHARS and report["traceback"].endswith(" the end\n")
    assert len(report["error"]) == 2000


def test_the_re_run_verdict_names_a_divergence_only_when_every_rank_reproduces_it():
    from training.integrity.detectors import IntegrityError
    from training.integrity.rerun import diverged_again

    nan = float("nan")
    shared = IntegrityError("nonfinite", 4, [0, 1], {})
    found = [("nonfinite", 4, [0], {}), ("nonfinite", 4, [1], {})]
    assert diverged_again(shared, found, nan, [{"rank": 0}, {"rank": 1}], 2) == {
        "what": "loss", "value": "nan", "step": 4}
    both_bad = [{"rank": 0, "local": (nan, True)}, {"rank": 1, "local": (nan, True)}]
    assert diverged_again(shared, found, 4.15, both_bad, 2)["what"] == "gradient norm"
    one_bad = [{"rank": 0, "local": (nan, True)}, {"rank": 1, "local": (3.0, False)}]
    assert diverged_again(shared, found, 4.15, one_bad, 2) is None  # did not reproduce everywhere
    assert diverged_again(shared, found[:1], 4.15, both_bad, 2) is None  # one rank named first
    spike = IntegrityError("loss_spike", 4, [0, 1], {})
    assert diverged_again(spike, found, nan, both_bad, 2) is None


def test_the_controller_and_the_engine_agree_on_which_gradient_checks_are_statistical():
    from training.integrity.rerun import STATISTICAL_KINDS

    assert classify.STATISTICAL_KINDS == STATISTICAL_KINDS


def test_a_spike_is_re_run_only_in_the_layout_it_was_seen_in():
    """After a replan the ranks compute other local gradients: their norms say nothing about the
    first attempt's, so the restart gets no spikes to compare (and nobody is blamed for a change)."""
    from training.config.layout import Layout
    from workers.controller.records import Recovery

    rec, big, small = Recovery(resume=True), Layout(dp=4), Layout(dp=2)
    rec.note_spike(7, {2: 40.5}, {2: "r1-n2"}, big)
    assert rec.spikes_to_rerun(big) == {7: {2: 40.5}} and rec.spikes_to_rerun(small) == {}
    rec.note_spike(9, {0: 3.25}, {0: "r1-n1"}, small)  # seen in the new layout: the old ones go
    assert rec.spikes_to_rerun(small) == {9: {0: 3.25}} and rec.rerun_nodes == {9: {0: "r1-n1"}}
    assert rec.spikes_to_rerun(big) == {}
