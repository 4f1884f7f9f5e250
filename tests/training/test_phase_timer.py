"""The per-phase step timers (training.phase_timer) reported with every step, and the controller's
medians after warm-up (workers.controller.perf)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import OptimConfig, RunConfig
from training.config.spec import ModelSpec
from training.phase_timer import PHASES, PhaseTimer
from workers.controller.perf import WARMUP_STEPS, StepPerf

SPEC = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=64)


def test_phase_timer_adds_up_marks_on_cpu() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    assert timer.read() == {}  # nothing started
    timer.start()
    time.sleep(0.002)
    timer.mark("compute")
    timer.mark("dp_sync")
    timer.mark("compute")  # a phase marked twice adds up
    phases = timer.read()
    assert set(phases) == {"compute", "dp_sync"}
    assert phases["compute"] >= 0.002 and all(v >= 0 for v in phases.values())


def _train_with_phases(rank: int, world: int) -> dict:
    from training.parallel.dist import DistContext
    from training.train import TrainHooks, train

    class Recorder(TrainHooks):
        def __init__(self) -> None:
            self.infos: list = []

        def on_step(self, info):
            self.infos.append(info)

    cfg = RunConfig(model=SPEC, layout=Layout(dp=2, micro_batch_size=1, num_microbatches=2), steps=3, seed=5,
                    optim=OptimConfig(lr=3e-3, eps=1e-5))
    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    rec = Recorder()
    result = train(ctx, cfg, rec, resume=False)
    return {"digest": result.model_digest, "phases": [dict(i.phases) for i in rec.infos],
            "step_times": [i.step_time_s for i in rec.infos]}


def test_every_step_reports_its_phases_within_the_step_time() -> None:
    out = run_ranks(2, _train_with_phases)
    assert out[0]["digest"] == out[1]["digest"]
    for res in out:
        for phases, step_time in zip(res["phases"], res["step_times"], strict=True):
            assert set(phases) == set(PHASES)
            assert phases["compute"] > 0
            assert sum(phases.values()) <= step_time + 1e-6


def test_step_perf_leaves_out_the_warm_up_of_every_attempt() -> None:
    perf = StepPerf()
    assert perf.summary() is None
    for i in range(1, 7):  # 3 warm-up steps (slow), then 3 timed ones
        perf.record(i, 9.0 if i <= WARMUP_STEPS else 0.1 * i, {"compute": 0.05, "dp_sync": 0.01})
    for i in range(1, 3):  # a new attempt: its first steps are warm-up again
        assert not perf.record(i, 7.0, {"compute": 5.0})
    s = perf.summary()
    assert s is not None
    assert s["steps"] == 3 and s["step_time_s"] == pytest.approx(0.5)
    assert s["phases_s"] == {"compute": pytest.approx(0.05), "dp_sync": pytest.approx(0.01)}
