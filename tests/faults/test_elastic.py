"""Growing back (workers.controller.elastic), without Ray: the decision against a fake topology (grows
only when capacity is there, never beyond max_gpus, the global batch kept), the state machine's
checkpoint-and-stop then replan up, no grow while a checkpoint is in flight, the shrink that respects
min_gpus, and the spec's bounds."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from service.api.operations import check_elastic_bounds
from service.api.problems import field_errors
from service.errors import InvalidRequest
from service.scheduler.admission import scaling_policy
from service.schemas import JobSpec
from tests.workers.dummy import DummyWorkerGroup, FakeClock, finished, running, step_events
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.controller import elastic
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.state import ControllerState
from workers.events import EventKind
from workers.policies import HoldLayoutPolicy, ScalingAction
from workers.topology import Topology

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
SHRUNK = Layout(dp=2, num_microbatches=2)  # DP 4 shrunk, global batch 4 kept


# ---- the decision --------------------------------------------------------------------------------
def test_grows_only_when_capacity_is_there_and_keeps_the_global_batch() -> None:
    held = {"r1-n2": 2}  # the job's own 2 ranks: freed when it stops to grow
    cordoned = Topology.uniform(1, 2, 2, used=held, cordoned=["r1-n1"])
    assert elastic.grow_layout(SHRUNK, cordoned, held, max_gpus=4) is None
    back = Topology.uniform(1, 2, 2, used=held)
    grown = elastic.grow_layout(SHRUNK, back, held, max_gpus=4)
    assert grown == Layout(dp=4, num_microbatches=1)
    assert grown.global_batch == SHRUNK.global_batch
    # another job took the returned GPUs: nothing to grow into
    taken = Topology.uniform(1, 2, 2, used={"r1-n1": 2, **held})
    assert elastic.grow_layout(SHRUNK, taken, held, max_gpus=4) is None
    # an excluded node (a failed one) does not count
    assert elastic.grow_layout(SHRUNK, back, held, max_gpus=4, exclude=["r1-n1"]) is None


def test_never_grows_beyond_max_gpus_nor_to_a_dp_that_breaks_the_global_batch() -> None:
    free = Topology.uniform(2, 2, 4)  # 16 GPUs
    layout = Layout(dp=2, num_microbatches=4)  # global batch 8
    assert elastic.grow_layout(layout, free, {}, max_gpus=2) is None
    assert elastic.grow_layout(layout, free, {}, max_gpus=4) == Layout(dp=4, num_microbatches=2)
    assert elastic.grow_layout(layout, free, {}, max_gpus=7) == Layout(dp=4, num_microbatches=2)  # 8 % 6
    assert elastic.grow_layout(layout, free, {}, max_gpus=64) == Layout(dp=8, num_microbatches=1)
    tp = Layout(tp=2, dp=1, num_microbatches=4)  # whole replicas of 2 GPUs
    assert elastic.grow_layout(tp, free, {}, max_gpus=5) == Layout(tp=2, dp=2, num_microbatches=2)


def test_the_shrink_keeps_the_global_batch_and_never_goes_below_min_gpus() -> None:
    policy = elastic.elastic_policy(min_gpus=2, max_gpus=None)
    layout = Layout(dp=4)
    two_left = Topology.uniform(1, 1, 4, used={"r1-n1": 2})
    decision = policy.on_unplaceable("short", layout, two_left, 1, 0.0)
    assert decision.action == ScalingAction.REPLAN
    assert decision.layout == Layout(dp=2, num_microbatches=2)
    one_left = Topology.uniform(1, 1, 4, used={"r1-n1": 3})
    assert policy.on_unplaceable("short", layout, one_left, 1, 0.0).action == ScalingAction.WAIT
    assert elastic.elastic_policy(None, None).on_unplaceable(
        "short", layout, one_left, 1, 0.0).layout == Layout(dp=1, num_microbatches=4)


# ---- the state machine ---------------------------------------------------------------------------


def _machine(tmp_path: Any, *, max_gpus: int = 4
             ) -> tuple[ControllerStateMachine, DummyWorkerGroup, FakeClock]:
    """An elastic job running shrunk (DP 2 x 2 micro-batches) on r1-n2; r1-n1 (2 GPUs) is cordoned."""
    clock = FakeClock()
    wg = DummyWorkerGroup(Topology.uniform(1, 2, 2))
    cfg = RunConfig(model=SPEC, layout=SHRUNK, steps=20,
                    checkpoint=CheckpointConfig(dir=str(tmp_path), every_steps=10))
    sm = ControllerStateMachine("el", cfg, wg, options=ControllerOptions(), clock=clock, wall_clock=clock,
                                scaling_policy=elastic.elastic_policy(2, max_gpus), cordoned=["r1-n1"])
    for _ in range(10):
        if sm.state == ControllerState.RUNNING:
            break
        sm.step()
    assert sm.state == ControllerState.RUNNING
    assert sm.growth is not None and {r["node_name"] for r in sm.job.placement} == {"r1-n2"}
    wg.push(running(2, events=step_events(2, 3, 3.0)))
    sm.step()
    return sm, wg, clock


def _poll(sm: ControllerStateMachine, wg: DummyWorkerGroup, clock: FakeClock, step: int,
          after_s: float = 6.0) -> None:
    clock.advance(after_s)
    wg.push(running(wg.world, events=step_events(wg.world, step, 3.0)))
    sm.step()


def _stopped_at(world: int, step: int) -> Any:
    done = finished(world, final_step=step)
    for r in range(world):
        done.ranks[r].events = [{"kind": "verified", "step": step},
                                {"kind": "checkpoint", "step": step, "path": "", "bytes": 1, "seconds": 0.1}]
    return done


def test_capacity_back_checkpoints_then_replans_up_with_the_global_batch(tmp_path: Any) -> None:
    sm, wg, clock = _machine(tmp_path)
    _poll(sm, wg, clock, 4)
    assert wg.actions == []  # r1-n1 still cordoned: nothing to grow into
    sm.update_nodes({}, [])  # uncordoned
    _poll(sm, wg, clock, 5, after_s=0.5)
    assert wg.actions == []  # checked every grow_check_s, not every poll
    _poll(sm, wg, clock, 6)
    assert wg.actions == ["checkpoint_and_stop"]
    _poll(sm, wg, clock, 7)
    assert wg.actions == ["checkpoint_and_stop"]  # asked once
    wg.push(_stopped_at(2, 8))
    sm.step()
    assert sm.state == ControllerState.PLACING
    [ev] = [e for e in sm.events if e["kind"] == EventKind.REPLANNED]
    assert ev["grew"] is True and ev["global_batch_kept"] is True and ev["step"] == 8
    assert ev["diff"] == {"dp": [2, 4], "num_microbatches": [2, 1]}
    for _ in range(5):
        if sm.state == ControllerState.RUNNING:
            break
        sm.step()
    assert sm.state == ControllerState.RUNNING and sm.run_cfg.layout == Layout(dp=4)
    assert wg.starts[-1]["resume"] is True and wg.starts[-1]["run_cfg"].layout.world_size == 4
    _poll(sm, wg, clock, 9)
    assert wg.actions == ["checkpoint_and_stop"]  # at max_gpus: never again


def test_a_checkpoint_boundary_looks_for_capacity_before_the_period(tmp_path: Any) -> None:
    """However fast the steps, a job grows within one checkpoint interval of the capacity's return."""
    sm, wg, clock = _machine(tmp_path)
    _poll(sm, wg, clock, 4)  # the periodic look: r1-n1 still cordoned
    sm.update_nodes({}, [])
    _poll(sm, wg, clock, 5, after_s=0.5)
    assert wg.actions == []  # no commit since the last look, and grow_check_s not over
    committed = running(wg.world, events={r: [{"kind": "checkpoint", "rank": r, "step": 5, "path": "",
                                               "bytes": 1, "seconds": 0.1}] for r in range(wg.world)})
    clock.advance(0.5)
    wg.push(committed)
    sm.step()  # the commit of step 5 is seen
    _poll(sm, wg, clock, 6, after_s=0.5)
    assert sm.job.progress["last_checkpoint_step"] == 5
    assert wg.actions == ["checkpoint_and_stop"]


def test_no_grow_while_a_checkpoint_is_in_flight_nor_beyond_max_gpus(tmp_path: Any) -> None:
    sm, wg, clock = _machine(tmp_path)
    sm.update_nodes({}, [])
    _poll(sm, wg, clock, 10)  # the periodic save of step 10 starts and is not committed yet
    assert sm.state == ControllerState.CHECKPOINTING and sm.attempt.ckpt_open == 10
    assert wg.actions == []
    capped, wg2, clock2 = _machine(tmp_path / "capped", max_gpus=2)
    capped.update_nodes({}, [])
    _poll(capped, wg2, clock2, 4)
    assert wg2.actions == []


def test_a_job_that_finishes_before_stopping_just_finishes(tmp_path: Any) -> None:
    sm, wg, clock = _machine(tmp_path)
    sm.update_nodes({}, [])
    _poll(sm, wg, clock, 4)
    assert wg.actions == ["checkpoint_and_stop"]
    wg.push(finished(2, final_step=20))
    sm.step()
    assert sm.state == ControllerState.FINISHED
    assert not [e for e in sm.events if e["kind"] == EventKind.REPLANNED]


def test_only_an_elastic_policy_grows() -> None:
    assert elastic.setup(HoldLayoutPolicy(), SHRUNK) is None
    growth = elastic.setup(elastic.elastic_policy(1, None), Layout(dp=4))
    assert growth is not None and growth.max_gpus == 4


# ---- the spec ------------------------------------------------------------------------------------
def _spec(**ft: Any) -> dict[str, Any]:
    return {"name": "el", "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16},
            "train": {"steps": 4, "global_batch": 4}, "parallelism": {"dp": 4}, "fault_tolerance": ft}


def test_the_spec_bounds_name_their_field() -> None:
    with pytest.raises(ValidationError) as bad:
        JobSpec.model_validate(_spec(elastic=True, min_gpus=4, max_gpus=2))
    [named] = field_errors(bad.value.errors())  # what the 422 problem+json says
    assert named.field == "fault_tolerance.min_gpus" and "max_gpus (2)" in named.message
    spec = JobSpec.model_validate(_spec(elastic=True, min_gpus=8))
    plan = {"layout": Layout(dp=4).to_dict()}
    with pytest.raises(InvalidRequest) as err:
        check_elastic_bounds(spec, plan)
    assert err.value.status == 422 and err.value.errors[0]["field"] == "fault_tolerance.min_gpus"
    check_elastic_bounds(JobSpec.model_validate(_spec(elastic=True, min_gpus=2)), plan)


def test_the_service_gives_an_elastic_job_the_planned_size_as_its_bound() -> None:
    assert scaling_policy(JobSpec.model_validate(_spec()), {"layout": Layout(dp=4).to_dict()}) is None
    replanned = {"layout": SHRUNK.to_dict(), "planned_layout": Layout(dp=4).to_dict()}
    policy = scaling_policy(JobSpec.model_validate(_spec(elastic=True, min_gpus=2)), replanned)
    assert isinstance(policy, elastic.ElasticPolicy) and (policy.min_gpus, policy.max_gpus) == (2, 4)
    bounded = scaling_policy(JobSpec.model_validate(_spec(elastic=True, max_gpus=8)), replanned)
    assert isinstance(bounded, elastic.ElasticPolicy) and bounded.max_gpus == 8
