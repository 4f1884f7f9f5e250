"""bench/api.py's own arithmetic and its generator's quiet collector (the load generator must not
charge its own garbage collection to the server's latency)."""

from __future__ import annotations

import gc
import weakref

import pytest

from bench import api


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_knee_is_where_the_curve_flattens() -> None:
    assert api.knee_of({100: 95.0, 200: 180.0, 300: 188.0, 400: 186.0}) == 200  # 180 >= 0.95 x 188
    assert api.knee_of({100: 100.0, 200: 150.0, 400: 190.0}) == 400


def test_a_sweep_served_in_full_has_no_knee() -> None:
    assert api.served_in_full({100: 100.0, 200: 199.9, 400: 399.3})
    assert not api.served_in_full({100: 100.0, 200: 199.9, 300: 231.1})  # the server's capacity reached
    assert not api.served_in_full({100: 100.0, 400: 300.0})


def test_4x_is_judged_pair_by_pair_against_the_knee_measured_beside_it() -> None:
    # a slow host minute that halves both runs of the second pair leaves its ratio alone
    pairs = [(260.0, 234.0), (130.0, 117.0), (250.0, 200.0)]
    assert api.paired_ratios(pairs) == pytest.approx([0.9, 0.9, 0.8])
    assert api.paired_ratios([(0.0, 10.0)]) == [0.0]


def test_alternating_chunks_merge_into_one_run() -> None:
    one = {"submit": api.OpStats(latencies=[0.01, 0.02], refused=[0.001]),
           "get": api.OpStats(latencies=[0.005], errors=1, timeouts=2),
           "_wall": api.OpStats(latencies=[4.0, 0.002, 3])}
    two = {"submit": api.OpStats(latencies=[0.03]), "get": api.OpStats(latencies=[0.004, 0.006]),
           "_wall": api.OpStats(latencies=[4.5, 0.009, 1])}
    two["get"].error_kinds["HTTP 500"] += 1
    merged = api.merge([one, two])
    assert merged["_wall"].latencies == [8.5, 0.009, 4]  # walls and connections add, the worst lag stays
    assert merged["submit"].latencies == [0.01, 0.02, 0.03] and merged["submit"].refused == [0.001]
    assert (merged["get"].errors, merged["get"].timeouts, merged["get"].error_kinds["HTTP 500"]) == (1, 2, 1)
    assert one["submit"].latencies == [0.01, 0.02]  # the chunks themselves are left as they were


def test_quiet_collector_pauses_cyclic_collection_for_the_run_and_collects_after() -> None:
    assert gc.isenabled()
    with api.quiet_collector():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what lived before the run is out of the collector's view
        before = gc.get_count()[0]
        cycles = [weakref.ref(_Cycle()) for _ in range(5 * gc.get_threshold()[0])]  # past gen0's threshold
        assert gc.get_count()[0] > before
        assert all(ref() is not None for ref in cycles)  # unreachable, and no collection ran
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    assert all(ref() is None for ref in cycles)  # the run's cycles collected


def test_quiet_collector_restores_the_collector_when_the_run_fails() -> None:
    with pytest.raises(RuntimeError), api.quiet_collector():
        raise RuntimeError("the service did not start")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_quiet_collector_leaves_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with api.quiet_collector():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
