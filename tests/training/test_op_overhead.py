"""The calibration's op overhead is the mean over windows spread across the calibration
(training.calibration.measure.OpOverheadSampler): a slow stretch of the host counts for the time
it took, as it does for a training step, instead of one short window's median deciding it."""

from __future__ import annotations

import pytest
import torch

from training.calibration.measure import OpOverheadSampler


class _Host:
    """A clock and a chain of 2 ops whose call takes `per_call` seconds of that clock."""

    def __init__(self) -> None:
        self.now, self.per_call, self.calls = 0.0, 0.001, 0

    def clock(self) -> float:
        return self.now

    def chain(self) -> None:
        self.calls += 1
        self.now += self.per_call


def test_windows_taken_in_a_fast_and_a_slow_stretch_average_by_time() -> None:
    host = _Host()
    s = OpOverheadSampler(torch.device("cpu"), window_s=0.01, ops=2, clock=host.clock, chain=host.chain)
    assert host.calls == 1 and s.calls == 0  # the warm-up call is not timed
    s.sample()  # fast: 10 calls of 1 ms
    host.per_call = 0.002
    s.sample()  # half speed: 5 calls of 2 ms
    assert s.calls == 15 and s.windows == pytest.approx([0.0005, 0.001])
    # 0.02 s over 15 calls of 2 ops: the slow window weighs by its time, not by its count of windows
    assert s.per_op() == pytest.approx(0.02 / 15 / 2)


def test_a_call_longer_than_the_window_is_still_one_timing() -> None:
    host = _Host()
    host.per_call = 0.5
    s = OpOverheadSampler(torch.device("cpu"), window_s=0.01, ops=4, clock=host.clock, chain=host.chain)
    assert s.per_op() == pytest.approx(0.5 / 4)  # sampled on demand when no window was taken
    assert s.calls == 1 and len(s.windows) == 1


def test_the_real_chain_measures_a_positive_cost_per_op() -> None:
    s = OpOverheadSampler(torch.device("cpu"), window_s=0.005)
    s.sample()
    s.sample()
    assert len(s.windows) == 2 and s.calls >= 2
    assert min(s.windows) * (1 - 1e-9) <= s.per_op() <= max(s.windows) * (1 + 1e-9) and s.per_op() > 0
