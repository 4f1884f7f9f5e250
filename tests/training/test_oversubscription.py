"""The oversubscription measurement (training/calibration/oversubscription.py): forked copies of the
calibrating process run one workload at once, on this host's real cores."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable

import pytest

from training.calibration import oversubscription as over


class ChildPids:
    """A workload wrapper that makes each forked copy write its pid once into a pipe."""

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.noted: set[int] = set()

    def wrap(self, workload: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            fn = workload()

            def step() -> None:
                pid = os.getpid()
                if pid != self.parent and pid not in self.noted:
                    self.noted.add(pid)
                    os.write(self.write_fd, struct.pack("i", pid))
                fn()

            return step

        return make

    def pids(self) -> list[int]:
        try:
            data = os.read(self.read_fd, 1 << 16)
        except BlockingIOError:
            data = b""
        os.close(self.read_fd)
        os.close(self.write_fd)
        return [p for (p,) in struct.iter_unpack("i", data)]


def _reaped(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a zombie (exited, not waited for) still answers
    except ProcessLookupError:
        return True
    return False


def test_each_workload_is_measured_at_each_level_by_forked_copies_all_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    children = ChildPids()
    monkeypatch.setitem(over.WORKLOADS, "ops", children.wrap(over.WORKLOADS["ops"]))
    got = over.measure_oversubscription(cores=2, levels=(1, 2), budget_s=0.01, timeout_s=120)
    pids = children.pids()
    assert set(got) == {"ops", "matmul"}
    for points in got.values():
        assert [a for a, _ in points] == [1.0, 2.0]  # processes per core
        assert all(f >= 1.0 for _, f in points)
    # Level 1 on 2 cores forks one copy, level 2 three: each ran the workload and was waited for.
    assert len(set(pids)) == 1 + 3
    assert all(_reaped(p) for p in pids)


def test_a_child_that_does_not_answer_is_killed_and_its_level_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parent = os.getpid()

    def stuck() -> Callable[[], None]:
        def step() -> None:
            if os.getpid() != parent:
                time.sleep(3600)  # if not killed, the measurement would wait for it: the test times out

        return step

    children = ChildPids()
    monkeypatch.setitem(over.WORKLOADS, "stuck", children.wrap(stuck))
    got = over.measure_oversubscription(cores=2, levels=(2,), budget_s=0.001, workloads=("stuck",),
                                        timeout_s=1.0)
    assert got == {"stuck": []}
    pids = children.pids()
    assert len(pids) == 3 and all(_reaped(p) for p in pids)
