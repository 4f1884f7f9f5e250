"""The controller keeps rank 0's step and phase times after warm-up in the job's progress
(workers.controller.perf), the measured side of "predicted vs measured"."""

from __future__ import annotations

import pytest

from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.perf import WARMUP_STEPS
from workers.controller.state import ControllerState
from workers.topology import Topology

from .dummy import DummyWorkerGroup, FakeClock, running, step_events

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)


def test_progress_carries_the_median_step_and_phase_times_after_warm_up() -> None:
    clock = FakeClock()
    wg = DummyWorkerGroup(Topology.uniform(1, 1, 2))
    sm = ControllerStateMachine("j1", RunConfig(model=SPEC, layout=Layout(dp=2), steps=20), wg,
                                options=ControllerOptions(hang_timeout_s=60.0, startup_timeout_s=300.0),
                                clock=clock, wall_clock=clock)
    for _ in range(10):
        if sm.state == ControllerState.RUNNING:
            break
        sm.step()
    assert sm.state == ControllerState.RUNNING
    times = {1: 5.0, 2: 3.0, 3: 2.0, 4: 0.2, 5: 0.3, 6: 0.25}  # the first WARMUP_STEPS are slow
    for step, t in times.items():
        phases = {"compute": t / 2, "dp_sync": 0.01 * step}
        wg.push(running(2, events=step_events(2, step, 3.0, step_time_s=t, phases=phases)))
        sm.step()
        perf = sm.snapshot()["progress"].get("perf")
        assert (perf is None) == (step <= WARMUP_STEPS)
    assert perf["steps"] == 3 and perf["warmup_steps"] == WARMUP_STEPS
    assert perf["step_time_s"] == pytest.approx(0.25)
    assert perf["phases_s"] == {"compute": pytest.approx(0.125), "dp_sync": pytest.approx(0.05)}
