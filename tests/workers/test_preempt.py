"""A preemption notice (workers.controller.preempt): the ranks checkpoint at the next step boundary and
stop, the controller ends PREEMPTED (job state `queued`) at that step with 0 steps lost; past the
grace period it stops anyway and counts the steps since the last checkpoint as lost."""

from __future__ import annotations

from typing import Any

from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.controller import preempt
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.state import JOB_STATE, ControllerState
from workers.events import EventKind
from workers.topology import Topology

from .dummy import DummyWorkerGroup, FakeClock, finished, running, step_events

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)




def _ckpt(world: int, step: int) -> dict[int, list[dict[str, Any]]]:
    return {r: [{"kind": "verified", "step": step},
                {"kind": "checkpoint", "step": step, "path": "", "bytes": 1, "seconds": 0.1}]
            for r in range(world)}


def _running_machine(tmp_path: Any) -> tuple[ControllerStateMachine, DummyWorkerGroup, FakeClock]:
    clock = FakeClock()
    wg = DummyWorkerGroup(Topology.uniform(1, 1, 2))
    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=20,
                    checkpoint=CheckpointConfig(dir=str(tmp_path), every_steps=5))
    sm = ControllerStateMachine("j1", cfg, wg, options=ControllerOptions(), clock=clock, wall_clock=clock)
    for _ in range(10):
        if sm.state == ControllerState.RUNNING:
            break
        sm.step()
    assert sm.state == ControllerState.RUNNING
    return sm, wg, clock


def _kinds(sm: ControllerStateMachine, kind: str) -> list[dict[str, Any]]:
    return [e for e in sm.events if e["kind"] == kind]


def test_a_notice_checkpoints_at_the_next_step_and_requeues_with_nothing_lost(tmp_path: Any) -> None:
    sm, wg, _ = _running_machine(tmp_path)
    wg.push(running(2, events=step_events(2, 7, 3.0)))
    sm.step()
    assert preempt.request(sm, "node drain", grace_s=60)
    assert not preempt.request(sm, "again", grace_s=60)  # one notice at a time
    wg.push(running(2, events=step_events(2, 8, 2.9)))
    sm.step()
    assert wg.actions == ["checkpoint_and_stop"]
    assert sm.state.training
    done = finished(2, final_step=8)
    for r, evs in _ckpt(2, 8).items():
        done.ranks[r].events = evs
    wg.push(done)
    sm.step()
    assert sm.state == ControllerState.PREEMPTED and sm.state.terminal
    assert JOB_STATE[sm.state] == "queued"
    [ev] = _kinds(sm, EventKind.PREEMPTED)
    assert (ev["step"], ev["restore_step"], ev["steps_lost"], ev["graceful"]) == (8, 8, 0, True)
    assert len(_kinds(sm, EventKind.PREEMPTION_REQUESTED)) == 1
    assert "preempted at step 8" in (sm.reason or "")
    assert "shutdown" in wg.calls


def test_past_the_grace_period_it_stops_anyway_and_counts_the_lost_steps(tmp_path: Any) -> None:
    sm, wg, clock = _running_machine(tmp_path)
    wg.push(running(2, events={r: step_events(2, 5, 3.0)[r] + _ckpt(2, 5)[r] for r in range(2)}))
    sm.step()
    wg.push(running(2, events=step_events(2, 7, 3.0)))
    sm.step()
    preempt.request(sm, "cloud notice", grace_s=30)
    sm.step()
    assert sm.state.training
    clock.advance(31)
    wg.push(running(2, events=step_events(2, 8, 2.9)))
    sm.step()
    assert sm.state == ControllerState.PREEMPTED
    [ev] = _kinds(sm, EventKind.PREEMPTED)
    assert (ev["step"], ev["restore_step"], ev["steps_lost"], ev["graceful"]) == (8, 5, 3, False)


def test_a_job_that_finishes_before_the_notice_takes_effect_succeeds(tmp_path: Any) -> None:
    sm, wg, _ = _running_machine(tmp_path)
    preempt.request(sm, "late notice", grace_s=60)
    wg.push(finished(2, final_step=20))
    sm.step()
    assert sm.state == ControllerState.FINISHED


def test_a_notice_while_not_training_stops_at_once(tmp_path: Any) -> None:
    clock = FakeClock()
    wg = DummyWorkerGroup(Topology.uniform(1, 1, 2))
    cfg = RunConfig(model=SPEC, layout=Layout(dp=2), steps=20, checkpoint=CheckpointConfig(dir=str(tmp_path)))
    sm = ControllerStateMachine("j1", cfg, wg, options=ControllerOptions(), clock=clock, wall_clock=clock)
    preempt.request(sm, "drain", grace_s=60)
    sm.step()
    assert sm.state == ControllerState.PREEMPTED
    assert wg.actions == []
