"""The controller's state machine, one transition at a time, against a dummy worker group."""

from __future__ import annotations

import dataclasses

import pytest

from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.state import ControllerState, Transition
from workers.policies import (
    Failure,
    FailureAction,
    FailureKind,
    HoldLayoutPolicy,
    ReplanPolicy,
    RestartPolicy,
    ScalingAction,
)
from workers.recovery_path import RecoveryPath
from workers.topology import Topology

from .dummy import DummyWorkerGroup, FakeClock, finished, running, step_events

S = ControllerState
SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
LAYOUT = Layout(tp=2, dp=2)  # 4 ranks


def _cfg(layout: Layout = LAYOUT, steps: int = 4, every: int = 2) -> RunConfig:
    return RunConfig(model=SPEC, layout=layout, steps=steps,
                     checkpoint=CheckpointConfig(dir="/ckpt", every_steps=every))


def make(layout: Layout = LAYOUT, topology: Topology | None = None, **kwargs):
    clock = FakeClock()
    wg = DummyWorkerGroup(topology or Topology.uniform(2, 2, 4))
    options = kwargs.pop("options", ControllerOptions(hang_timeout_s=60.0, startup_timeout_s=300.0))
    sm = ControllerStateMachine(
        "j1", _cfg(layout), wg, options=options, clock=clock, wall_clock=clock, **kwargs
    )
    return sm, wg, clock


def drive(sm: ControllerStateMachine, to: ControllerState, max_steps: int = 10) -> None:
    for _ in range(max_steps):
        if sm.state == to:
            return
        sm.step()
    assert sm.state == to, f"stuck in {sm.state}, wanted {to}"


def kinds(sm: ControllerStateMachine) -> list[str]:
    return [e["kind"] for e in sm.events]


def to_running(**kwargs):
    sm, wg, clock = make(**kwargs)
    drive(sm, S.RUNNING)
    return sm, wg, clock


# ---- INIT / PLACING / WAITING ---------------------------------------------------------------------


def test_init_goes_to_placing():
    sm, wg, _ = make()
    t = sm.step()
    assert t == Transition(S.INIT, S.PLACING, "placing the ranks")
    assert kinds(sm) == ["controller_started", "state"]
    assert wg.calls == []


def test_placing_reserves_the_placement_and_goes_to_starting():
    sm, wg, _ = make()
    sm.step()
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.PLACING, S.STARTING)
    assert wg.calls == ["topology", "reserve"]
    assert wg.reserved.world_size == 4
    snap = sm.snapshot()
    assert snap["job_state"] == "starting" and len(snap["placement"]) == 4
    placed = [e for e in sm.events if e["kind"] == "placed"][0]
    assert placed["placement"] == wg.reserved.to_list()


def test_no_capacity_waits_with_the_reason_and_retries_after_the_policy_delay():
    sm, wg, clock = make(layout=Layout(tp=4, dp=5), scaling_policy=HoldLayoutPolicy(retry_after_s=2.0))
    sm.step()
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.PLACING, S.WAITING)
    assert "needs 20 GPUs in groups of 4" in t.reason
    snap = sm.snapshot()
    assert snap["job_state"] == "queued" and "needs 20 GPUs" in snap["reason"]
    assert "reserve" not in wg.calls
    assert sm.step() is None  # not yet time
    clock.advance(2.5)
    assert sm.step().to_state == S.PLACING
    assert sm.step().to_state == S.WAITING
    # the same reason is logged once, not on every retry
    assert kinds(sm).count("placement_failed") == 1


def test_reservation_timeout_waits_then_places_when_capacity_returns():
    sm, wg, clock = make()
    wg.reserve_error = "placement group not granted within 30s"
    sm.step()
    assert sm.step().to_state == S.WAITING
    assert sm.reason == "placement group not granted within 30s"
    wg.reserve_error = None
    clock.advance(5)
    sm.step()
    assert sm.step().to_state == S.STARTING


def test_waiting_errors_when_the_scaling_policy_gives_up():
    policy = HoldLayoutPolicy(retry_after_s=1, max_wait_s=5)
    sm, wg, clock = make(layout=Layout(tp=4, dp=5), scaling_policy=policy)
    drive(sm, S.WAITING)
    clock.advance(6)
    sm.step()
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.PLACING, S.ERRORED)
    assert "no capacity for 6s" in sm.reason
    assert sm.snapshot()["job_state"] == "failed"


def test_replan_policy_swaps_the_layout_and_places_the_new_one():
    small = Layout(tp=2, dp=4)
    policy = ReplanPolicy(replanner=lambda topo, layout: small)
    sm, wg, _ = make(layout=Layout(tp=4, dp=5), scaling_policy=policy)
    sm.step()
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.PLACING, S.PLACING)
    replanned = [e for e in sm.events if e["kind"] == "replanned"][0]
    assert replanned["new_layout"]["dp"] == 4 and replanned["old_layout"]["dp"] == 5
    assert sm.step().to_state == S.STARTING
    sm.step()
    assert wg.starts[0]["run_cfg"].layout == small
    assert sm.snapshot()["layout"]["dp"] == 4


def test_nodes_cordoned_later_are_avoided_by_the_next_placement():
    sm, wg, _ = make(topology=Topology.uniform(1, 2, 4))
    sm.update_nodes({"r1-n2": "quarantined"}, ["r1-n1"])
    sm.step()
    assert sm.step().to_state == S.WAITING  # nothing usable left
    assert wg.seen_cordoned == {"r1-n1"} and wg.seen_health == {"r1-n2": "quarantined"}
    assert "r1-n1 (cordoned)" in sm.reason and "r1-n2 (quarantined)" in sm.reason


# ---- STARTING -----------------------------------------------------------------------------------------


def test_starting_runs_the_ranks_and_reports_where_they_really_are():
    sm, wg, _ = make()
    drive(sm, S.STARTING)
    wg.landed = [dataclasses.replace(r, gpu=r.gpu + 10) for r in wg.reserved.ranks]
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.STARTING, S.RUNNING)
    assert [r["gpu"] for r in sm.snapshot()["placement"]] == [r.gpu for r in wg.landed]
    assert wg.starts[0]["resume"] is True  # options.resume: continue from a checkpoint if there is one
    assert sm.snapshot()["job_state"] == "running"


def test_a_rank_landing_off_its_planned_node_is_reported():
    sm, wg, _ = make()
    drive(sm, S.STARTING)
    wg.landed = [dataclasses.replace(r, node_id="elsewhere") if r.rank == 3 else r for r in wg.reserved.ranks]
    sm.step()
    mismatch = [e for e in sm.events if e["kind"] == "placement_mismatch"]
    assert mismatch and mismatch[0]["ranks"] == [3]


def test_startup_failure_restarts_and_the_next_start_resumes():
    sm, wg, _ = make(options=ControllerOptions(resume=False))
    drive(sm, S.STARTING)
    wg.start_error = "rendezvous failed"
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.STARTING, S.RECOVERING)
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "startup" and "rendezvous failed" in failure["message"]
    wg.start_error = None
    assert sm.step().to_state == S.PLACING
    assert sm.restarts == 1
    drive(sm, S.RUNNING)
    assert [s["resume"] for s in wg.starts] == [True]  # the failed first start never recorded


# ---- RUNNING / CHECKPOINTING ------------------------------------------------------------------------


def test_running_collects_progress_and_stays_running():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 1, 4.25, tokens_per_s=512.0)))
    assert sm.step() is None
    p = sm.snapshot()["progress"]
    assert (p["step"], p["loss"], p["tokens_per_s"], p["total_steps"]) == (1, 4.25, 512.0, 4)


def test_checkpoint_cadence_enters_checkpointing_until_every_rank_committed():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 2, 3.0)))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.CHECKPOINTING)
    saved = {
        r: [{"kind": "checkpoint", "rank": r, "step": 2, "path": "/ckpt/step-2", "bytes": 10, "seconds": 0.1}]
        for r in range(4)
    }
    wg.push(running(4, events={r: saved[r] for r in range(3)}))
    assert sm.step() is None and sm.state == S.CHECKPOINTING  # 3 of 4 ranks
    wg.push(running(4, events={3: saved[3]}))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.CHECKPOINTING, S.RUNNING)
    ev = [e for e in sm.events if e["kind"] == "checkpoint_saved"]
    assert len(ev) == 1 and ev[0]["step"] == 2 and ev[0]["path"] == "/ckpt/step-2"
    assert sm.snapshot()["progress"]["last_checkpoint_step"] == 2


def test_steps_off_the_cadence_do_not_checkpoint():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 1, 3.0)), running(4, events=step_events(4, 3, 2.0)))
    assert sm.step() is None and sm.step() is None
    assert sm.state == S.RUNNING


def test_all_ranks_finished_gives_the_result_and_releases_the_group():
    sm, wg, _ = to_running()
    wg.push(finished(4, digest="d1g35t"))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.FINISHED)
    snap = sm.snapshot()
    assert snap["result"]["model_digest"] == "d1g35t" and snap["result"]["final_step"] == 4
    assert snap["result"]["losses"] == [4.0, 3.5, 3.0, 2.5]
    assert snap["job_state"] == "succeeded" and snap["terminal"]
    assert wg.calls[-1] == "shutdown"
    assert sm.step() is None  # terminal states never change
    sm.request_cancel()
    assert sm.step() is None and sm.state == S.FINISHED


def test_finished_from_checkpointing():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 4, 2.0)))
    assert sm.step().to_state == S.CHECKPOINTING
    wg.push(finished(4))
    assert sm.step().to_state == S.FINISHED


# ---- failures -----------------------------------------------------------------------------------------


def test_dead_rank_restarts_avoiding_nothing_but_marks_its_node_suspect():
    sm, wg, _ = to_running()
    node_of_1 = wg.reserved.ranks[1].node_name
    wg.push(running(4, state={1: "dead"}, error={1: "ActorDiedError: the actor died"}))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.RECOVERING)
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "rank_died" and failure["ranks"] == [1] and failure["nodes"] == [node_of_1]
    assert [e["node"] for e in sm.events if e["kind"] == "node_suspect"] == [node_of_1]
    assert sm.snapshot()["job_state"] == "recovering"
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RECOVERING, S.PLACING)
    assert wg.calls[-1] == "shutdown" and sm.restarts == 1
    # The fast path failed (this group cannot replace single ranks): the restart event says so.
    restart = [e for e in sm.events if e["kind"] == "restart"][0]
    assert [e["kind"] for e in sm.events].count("fast_path_failed") == 1
    assert restart["path"] == "full" and restart["recovery"]["path"] == "checkpoint"
    assert restart["recovery"]["why"].startswith("replacing ranks [1] failed: ")
    assert "cannot replace single ranks" in restart["message"]
    drive(sm, S.RUNNING)
    assert wg.seen_health == {node_of_1: "suspect"}
    assert node_of_1 not in {r.node_name for r in wg.reserved.ranks}  # suspect nodes are used last
    assert wg.starts[-1]["resume"] is True


class ReplacingGroup(DummyWorkerGroup):
    """Replaces single ranks (the fast path): records which, and restores them from the checkpoint."""

    def __init__(self, topology: Topology) -> None:
        super().__init__(topology)
        self.replaced: list[list[int]] = []

    def replace_ranks(self, ranks, run_cfg, **kwargs):
        self.replaced.append(sorted(ranks))
        self.last_recovery = RecoveryPath("checkpoint", "scripted", lost=tuple(sorted(ranks)))
        return list(self.reserved.ranks)


@pytest.mark.parametrize("quarantined", [True, False], ids=["quarantined", "suspect"])
def test_ranks_that_survived_on_a_quarantined_node_are_replaced_with_the_lost_one(quarantined):
    # quarantine_after = quarantine_jobs = 1: the dead rank's node is quarantined at once (the default
    # makes it a suspect, whose survivors keep their processes).
    policy = {"quarantine_after": 1, "quarantine_jobs": 1} if quarantined else {}
    wg = ReplacingGroup(Topology.uniform(2, 2, 4))
    sm = ControllerStateMachine("j1", _cfg(), wg, options=ControllerOptions(**policy), clock=FakeClock())
    drive(sm, S.RUNNING)
    node = wg.reserved.ranks[1].node_name
    on_node = sorted(r.rank for r in wg.reserved.ranks if r.node_name == node)
    assert len(on_node) > 1  # rank 1 shares its node with survivors
    wg.push(running(4, state={1: "dead"}, error={1: "ActorDiedError: the actor died"}))
    sm.step()
    assert (node in sm.snapshot()["quarantined_nodes"]) is quarantined
    assert sm.step().to_state == S.RUNNING
    restart = [e for e in sm.events if e["kind"] == "restart"][0]
    assert restart["path"] == "fast"
    if quarantined:
        assert wg.replaced == [on_node] and restart["evicted"] == [r for r in on_node if r != 1]
        assert f"ranks {restart['evicted']} moved off the quarantined node" in restart["message"]
    else:
        assert wg.replaced == [[1]] and "evicted" not in restart


def test_a_dead_rank_is_blamed_before_ranks_that_failed_because_of_it():
    sm, wg, _ = to_running()
    wg.push(running(4, state={0: "failed", 3: "dead"}, error={0: "RuntimeError: connection reset"}))
    sm.step()
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "rank_died" and failure["ranks"] == [3]


def test_training_error_on_a_rank_restarts():
    sm, wg, _ = to_running()
    wg.push(running(4, state={2: "failed"}, error={2: "ValueError: boom"}))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "rank_error" and "ValueError: boom" in failure["message"]
    sm.step()
    restart = [e for e in sm.events if e["kind"] == "restart"][0]
    assert restart["recovery"]["why"] == "the fast path does not apply to a rank_error failure"
    assert "fast_path_failed" not in [e["kind"] for e in sm.events]


def test_hang_is_detected_by_the_heartbeat_timeout_and_blamed_on_the_rank_that_stopped_first():
    sm, wg, _ = to_running()
    wg.push(running(4, since_progress_s={0: 59.0, 1: 59.0, 2: 59.0, 3: 59.0}))
    assert sm.step() is None  # within the timeout
    wg.push(running(4, step={0: 3, 1: 2, 2: 3, 3: 3}, since_progress_s={0: 61.0, 1: 75.0, 2: 61.0, 3: 61.0}))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [1]
    assert sorted(failure["evidence"]["stale_ranks"]) == [0, 1, 2, 3]


def test_a_job_whose_steps_outlast_the_heartbeat_timeout_is_not_hung_until_several_steps_pass():
    """A rank reports progress about once a step: with steps of 20 s (a big model, a loaded host)
    the 60 s heartbeat timeout would call every slow step a hang. The limit becomes
    `hang_step_factor` (5) median step times: 100 s here."""
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 1, 4.0, step_time_s=20.0)))
    assert sm.step() is None
    wg.push(running(4, since_progress_s={r: 90.0 for r in range(4)}))
    assert sm.step() is None  # past the heartbeat timeout, within five typical steps
    late = {0: 101.0, 1: 101.0, 2: 130.0, 3: 101.0}
    wg.push(running(4, step={0: 2, 1: 2, 2: 1, 3: 2}, since_progress_s=late))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [2], failure


def test_a_rank_that_misses_polls_in_a_slow_job_gets_the_same_longer_limit():
    """An actor that does not answer polls (its process starved on a loaded host) is hung after
    the same limit: the heartbeat timeout or five typical steps."""
    sm, wg, clock = to_running()
    wg.push(running(4, events=step_events(4, 1, 4.0, step_time_s=20.0)))
    assert sm.step() is None
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step() is None
    clock.advance(90)  # past the heartbeat timeout (60 s), within five steps of 20 s
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step() is None
    clock.advance(11)
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [2] and "over 100s" in failure["message"]


def test_startup_timeout_applies_until_a_rank_made_its_first_step():
    sm, wg, _ = to_running()
    wg.push(running(4, stepped={r: False for r in range(4)}, since_progress_s={0: 200.0}))
    assert sm.step() is None  # 200s > hang timeout but < startup timeout
    wg.push(running(4, stepped={r: False for r in range(4)}, since_progress_s={0: 301.0}))
    assert sm.step().to_state == S.RECOVERING


def test_unresponsive_rank_is_a_hang_only_after_the_timeout():
    sm, wg, clock = to_running()
    wg.push(running(4))  # every rank answers and has stepped in this attempt
    assert sm.step() is None
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step() is None
    clock.advance(61)
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [2] and "over 60s" in failure["message"]


def test_a_rank_that_has_not_stepped_may_be_unresponsive_for_the_startup_timeout():
    """A fresh rank (a replacement importing torch on a loaded node) may miss polls while it starts."""
    sm, wg, clock = to_running()
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step() is None
    clock.advance(61)  # past the hang timeout, within the start-up timeout
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step() is None
    clock.advance(240)
    wg.push(running(4, state={2: "unresponsive"}))
    assert sm.step().to_state == S.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "hang" and failure["ranks"] == [2] and "over 300s" in failure["message"]


def test_an_integrity_error_is_an_sdc_failure_blaming_the_ranks_the_engine_named():
    sm, wg, _ = to_running()
    err = {"kind": "integrity_error", "error_kind": "divergent_replicas", "step": 3, "ranks": [2],
           "evidence": {"dp_group": [0, 2]}, "message": "divergent_replicas at step 3 on ranks [2]"}
    wg.push(running(4, state={r: "failed" for r in range(4)}, error={r: "IntegrityError" for r in range(4)},
                    events={r: [dict(err, rank=r)] for r in range(4)}))
    assert sm.step().to_state == S.RECOVERING
    assert [e["error_kind"] for e in sm.events if e["kind"] == "integrity_error"] == ["divergent_replicas"]
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert failure["kind"] == "sdc" and failure["ranks"] == [2] and failure["step"] == 3
    assert failure["nodes"] == [wg.reserved.ranks[2].node_name]


def _persistent_pair(sm, wg, referee_result):
    """Ranks 0 and 2 (one DP pair) disagree again on the re-run; the referee answers `referee_result`."""
    calls = []

    def referee(run_cfg, request, exclude):
        calls.append((request["snapshot"], sorted(exclude)))
        if isinstance(referee_result, Exception):
            raise referee_result
        return referee_result

    sm.attributor.referee = referee
    request = {"snapshot": "/ckpt/referee/step-3.pt", "step": 3, "dp_group": [0, 2],
               "fingerprints": {"0": "aa", "2": "bb"}}
    err = {"kind": "integrity_error", "error_kind": "divergent_replicas", "step": 3, "ranks": [0, 2],
           "evidence": {"attribution": "rerun from the pre-step snapshot", "transient": False,
                        "referee": request}, "message": "divergent_replicas at step 3 on ranks [0, 2]"}
    wg.push(running(4, state={r: "failed" for r in range(4)}, error={r: "IntegrityError" for r in range(4)},
                    events={r: [dict(err, rank=r)] for r in range(4)}))
    assert sm.step().to_state == S.RECOVERING
    return calls


@pytest.mark.parametrize("culprit", [0, 2])
def test_a_referee_names_the_replica_it_does_not_reproduce(culprit):
    sm, wg, _ = to_running()
    healthy = 2 if culprit == 0 else 0
    fingerprint = {"0": "aa", "2": "bb"}[str(healthy)]
    calls = _persistent_pair(sm, wg, {"fingerprint": fingerprint, "node": "spare-node", "step": 3})
    nodes = {r: wg.reserved.ranks[r].node_name for r in (0, 2)}
    assert calls == [("/ckpt/referee/step-3.pt", sorted(set(nodes.values())))]  # the suspects stay out
    assert kinds(sm).index("referee_started") < kinds(sm).index("referee") < kinds(sm).index("attributed")
    failure = sm.recovery.failure
    assert failure.ranks == (culprit,) and failure.nodes == (nodes[culprit],)
    assert failure.evidence["evidence"]["referee"]["healthy"] == [healthy]
    assert sm.quarantined_nodes == [nodes[culprit]]


def test_an_inconclusive_referee_leaves_both_replicas_under_suspicion():
    for answer in ({"fingerprint": "cc", "node": "spare-node", "step": 3}, RuntimeError("no spare")):
        sm, wg, _ = to_running()
        _persistent_pair(sm, wg, answer)
        assert "referee" not in kinds(sm) and "referee_inconclusive" in kinds(sm)
        assert sm.recovery.failure.ranks == (0, 2)


def test_a_long_checkpoint_save_is_not_a_hang():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 2, 3.0)))
    assert sm.step().to_state == S.CHECKPOINTING
    wg.push(running(4, since_progress_s={r: 120.0 for r in range(4)}))
    assert sm.step() is None  # 120s > hang timeout (60s) but < checkpoint timeout (600s)
    wg.push(running(4, since_progress_s={r: 601.0 for r in range(4)}))
    assert sm.step().to_state == S.RECOVERING


def test_failure_while_checkpointing_recovers():
    sm, wg, _ = to_running()
    wg.push(running(4, events=step_events(4, 2, 3.0)))
    assert sm.step().to_state == S.CHECKPOINTING
    wg.push(running(4, state={0: "dead"}))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.CHECKPOINTING, S.RECOVERING)


def test_restart_budget_spent_fails_the_job_with_the_reason():
    sm, wg, _ = to_running(failure_policy=RestartPolicy(max_restarts=1))
    wg.push(running(4, state={1: "dead"}))
    assert sm.step().to_state == S.RECOVERING
    drive(sm, S.RUNNING)
    wg.push(running(4, state={1: "dead"}))
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.ERRORED)
    assert "restart budget spent (1 of max_restarts=1)" in sm.reason
    assert wg.calls[-1] == "shutdown"
    assert sm.snapshot()["job_state"] == "failed"


def test_avoid_failed_nodes_keeps_the_restart_off_them_when_capacity_allows():
    policy = RestartPolicy(avoid_failed_nodes=True)
    sm, wg, _ = to_running(topology=Topology.uniform(1, 2, 4), failure_policy=policy)
    bad = wg.reserved.ranks[0].node_name
    wg.push(running(4, state={0: "dead"}))
    sm.step()
    drive(sm, S.RUNNING)
    assert bad not in {r.node_name for r in wg.reserved.ranks}


def test_avoiding_failed_nodes_is_only_a_preference():
    policy = RestartPolicy(avoid_failed_nodes=True)
    topo = Topology.uniform(1, 2, 4)
    sm, wg, _ = to_running(layout=Layout(tp=2, dp=4), topology=topo, failure_policy=policy)
    wg.push(running(8, state={0: "dead"}))
    sm.step()
    drive(sm, S.RUNNING)  # all 8 GPUs are needed, the failed node included
    assert len({r.node_name for r in wg.reserved.ranks}) == 2


def test_faults_are_armed_until_the_job_passed_their_step():
    faults = ({"kind": "kill_rank", "rank": 1, "at_step": 2}, {"kind": "hang_rank", "rank": 0, "at_step": 9})
    sm, wg, _ = to_running(options=ControllerOptions(faults=faults))
    assert [f["kind"] for f in wg.starts[0]["faults"]] == ["kill_rank", "hang_rank"]
    wg.push(running(4, events=step_events(4, 2, 3.0)), running(4, state={1: "dead"}))
    sm.step()
    sm.step()
    drive(sm, S.RUNNING)
    assert [f["kind"] for f in wg.starts[1]["faults"]] == ["hang_rank"]


# ---- cancel, errors, the event log ---------------------------------------------------------------------


@pytest.mark.parametrize("state", [S.INIT, S.PLACING, S.WAITING, S.STARTING, S.RUNNING, S.CHECKPOINTING,
                                   S.RECOVERING])
def test_cancel_from_every_live_state(state):
    layout = Layout(tp=4, dp=5) if state == S.WAITING else LAYOUT
    sm, wg, _ = make(layout=layout)
    if state == S.CHECKPOINTING:
        drive(sm, S.RUNNING)
        wg.push(running(4, events=step_events(4, 2, 3.0)))
    elif state == S.RECOVERING:
        drive(sm, S.RUNNING)
        wg.push(running(4, state={0: "dead"}))
    drive(sm, state)
    sm.request_cancel("cancelled by alice")
    t = sm.step()
    assert (t.from_state, t.to_state) == (state, S.CANCELLED)
    assert wg.calls[-1] == "shutdown"
    snap = sm.snapshot()
    assert snap["job_state"] == "cancelled" and snap["reason"] == "cancelled by alice"
    assert sm.step() is None


def test_an_error_inside_the_worker_group_fails_the_job_instead_of_hanging():
    sm, wg, _ = to_running()
    wg.poll_error = RuntimeError("GCS unreachable")
    t = sm.step()
    assert (t.from_state, t.to_state) == (S.RUNNING, S.ERRORED)
    assert "controller error in RUNNING: RuntimeError: GCS unreachable" in sm.reason
    assert wg.calls[-1] == "shutdown"


def test_event_log_is_ordered_and_read_incrementally():
    sm, wg, _ = make(options=ControllerOptions(first_seq=100))
    drive(sm, S.RUNNING)
    snap = sm.snapshot()
    seqs = [e["seq"] for e in snap["events"]]
    assert seqs == list(range(101, 101 + len(seqs))) and snap["last_seq"] == seqs[-1]
    assert [e["kind"] for e in snap["events"]][:2] == ["controller_started", "state"]
    wg.push(finished(4))
    sm.step()
    later = sm.snapshot(since_seq=snap["last_seq"])["events"]
    assert [e["kind"] for e in later] == ["finished", "state"]
    assert all(e["seq"] > snap["last_seq"] for e in later)


def test_state_names_and_terminal_flags():
    assert {s for s in S if s.terminal} == {S.FINISHED, S.ERRORED, S.CANCELLED, S.PREEMPTED}


# ---- policies -----------------------------------------------------------------------------------------


def test_restart_policy_decisions():
    f = Failure(FailureKind.RANK_DIED, "gone", ranks=(1,), nodes=("r1-n1",))
    d = RestartPolicy(max_restarts=2).decide(f, restarts=1)
    assert d.action == FailureAction.RETRY and d.suspect_nodes == ("r1-n1",) and d.exclude_nodes == ()
    assert RestartPolicy(max_restarts=2, avoid_failed_nodes=True).decide(f, 0).exclude_nodes == ("r1-n1",)
    assert RestartPolicy(max_restarts=2).decide(f, restarts=2).action == FailureAction.RAISE
    startup = Failure(FailureKind.STARTUP, "no actors", nodes=("r1-n1",))
    assert RestartPolicy().decide(startup, 0).suspect_nodes == ()


def test_scaling_policies():
    topo = Topology.uniform(1, 1, 4)
    hold = HoldLayoutPolicy(retry_after_s=3, max_wait_s=10)
    assert hold.on_unplaceable("full", LAYOUT, topo, 1, 9.0).action == ScalingAction.WAIT
    assert hold.on_unplaceable("full", LAYOUT, topo, 5, 10.0).action == ScalingAction.FAIL
    none = ReplanPolicy(replanner=lambda t, lay: None, max_wait_s=5)
    assert none.on_unplaceable("full", LAYOUT, topo, 1, 1.0).action == ScalingAction.WAIT
    assert none.on_unplaceable("full", LAYOUT, topo, 1, 6.0).action == ScalingAction.FAIL
    same = ReplanPolicy(replanner=lambda t, lay: lay)
    assert same.on_unplaceable("full", LAYOUT, topo, 1, 1.0).action == ScalingAction.WAIT
