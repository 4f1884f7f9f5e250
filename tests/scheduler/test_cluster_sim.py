"""bench/cluster_sim.py runs the service's own decision functions, and its quick run prints every
figure the issue asks for."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bench import cluster_model as cm
from bench import cluster_sim
from service.scheduler import admission, fairshare, preemption
from workers import placement


def test_the_simulator_calls_the_functions_the_service_calls() -> None:
    assert cluster_sim.DECIDE is fairshare.decide
    assert cluster_sim.FIFO is fairshare.fifo_decide
    assert cluster_sim.PLACE is placement.place
    assert cluster_sim.CHOOSE_VICTIMS is preemption.choose_victims
    assert admission.fairshare is fairshare  # queue_decisions calls fairshare.decide, the same object


def test_a_simulated_run_schedules_through_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def spy(waiting: Any, *args: Any, **kwargs: Any) -> list[fairshare.Decision]:
        calls.append(len(waiting))
        return fairshare.decide(waiting, *args, **kwargs)

    trace = cm.make_trace(40, seed=3, nodes=32)
    sim = cluster_sim.simulate(trace, spy, young_daly=True, nodes=32, seed=3)
    assert calls and max(calls) >= 1
    assert not sim.running and not sim.waiting  # every job ran to the end
    result = sim.result("fair share", "Young/Daly")
    assert 0.0 < result.utilisation <= 1.0 and 0.0 < result.goodput <= 1.0


def test_quick_run_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster_sim.main(["--quick", "--jobs", "60", "--nodes", "32"]) == 0
    text = capsys.readouterr().out
    for figure in ("decision latency, fair share", "decision latency, FIFO", "p99", "utilisation", "goodput",
                   "Jain's index", "preemptions", "steps lost", "Young/Daly vs fixed", "FIFO+priority"):
        assert figure in text, figure
    fair, fifo = re.search(r"Jain's index: fair share ([\d.]+), FIFO ([\d.]+)", text).groups()  # type: ignore[union-attr]
    assert 0.0 <= float(fair) <= 1.0 and 0.0 <= float(fifo) <= 1.0
    assert re.search(r"preemptions \(.*\): \d+, steps lost to them: 0", text)


def test_preempted_jobs_keep_their_work_and_every_job_finishes() -> None:
    trace = cm.make_trace(80, seed=5, nodes=32, load=2.0)
    sim = cluster_sim.simulate(trace, cluster_sim.DECIDE, young_daly=True, nodes=32, seed=5, preempt=True)
    assert sim.preemptions > 0
    assert not sim.running and not sim.waiting
    assert all(job.remaining_s == 0 for job in sim.jobs.values())
    assert sim.useful == pytest.approx(sum(t.gpus * t.work_s for t in trace))  # kept work counted once


def test_model_formulas() -> None:
    # Llama 3: 419 interruptions in 54 days on 16,384 GPUs -> one every ~3.09 h on the whole cluster
    assert cm.mtbf_s(16_384) == pytest.approx(54 * 86_400 / 419)
    assert cm.young_daly_interval(10.0, 20_000.0) == pytest.approx(632.455, rel=1e-4)
    assert cm.weighted_fair(12, {"a": 100, "b": 100, "c": 1}, {"a": 2, "b": 1, "c": 1}) == \
        pytest.approx({"a": 22 / 3, "b": 11 / 3, "c": 1})
    assert cm.jain([1, 1, 1, 1]) == 1.0 and cm.jain([1, 0, 0, 0]) == 0.25
