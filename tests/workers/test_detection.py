"""Failure detection is pure (workers.controller.detection): what a poll of the ranks shows."""

from __future__ import annotations

from workers.controller.attempt import Attempt
from workers.controller.detection import death, detect
from workers.controller.options import ControllerOptions
from workers.group_interface import GroupStatus, RankStatus
from workers.policies import FailureKind


def _attempt() -> Attempt:
    return Attempt(rank_node={0: "n0", 1: "n0", 2: "n1", 3: "n1"})


def test_a_dead_node_takes_every_rank_it_held_even_before_their_deaths_are_polled():
    """Rank 2's actor is seen dead first; rank 3 shares its node, which left the cluster: both are
    lost (replacing rank 2 alone would pair it with a dead TP peer)."""
    status = GroupStatus({0: RankStatus(0, "running"), 1: RankStatus(1, "running"),
                          2: RankStatus(2, "dead", error="actor died"), 3: RankStatus(3, "running")})
    failure = death([2], status, _attempt(), node_gone=lambda n: n == "n1", step=3)
    assert failure.kind == FailureKind.NODE_DIED
    assert (failure.ranks, failure.nodes) == ((2, 3), ("n1",))


def test_a_dead_rank_on_a_live_node_is_a_rank_death_of_that_rank_only():
    status = GroupStatus({r: RankStatus(r, "dead" if r == 2 else "running") for r in range(4)})
    failure = death([2], status, _attempt(), node_gone=lambda n: False, step=3)
    assert failure.kind == FailureKind.RANK_DIED
    assert (failure.ranks, failure.nodes) == ((2,), ("n1",))


def test_a_hang_is_blamed_on_the_rank_that_never_entered_the_collective_even_when_its_peer_goes_stale_first():
    """Rank 0 stopped right after its step-3 report; rank 1 reported entering the step's collective a
    few milliseconds earlier, so rank 1 passes the heartbeat timeout first. It waits for rank 0: the
    reports of every running rank are compared, not only those of the stale ones (which blamed rank 1)."""
    attempt = Attempt(rank_node={0: "n0", 1: "n1"}, stepped={0, 1}, markers={0: (3, 0), 1: (3, 1)})
    status = GroupStatus({0: RankStatus(0, "running", since_progress_s=3.99, stepped=True, step=3),
                          1: RankStatus(1, "running", since_progress_s=4.01, stepped=True, step=3)})
    failure = detect(status, 100.0, attempt, ControllerOptions(hang_timeout_s=4.0), 3,
                     node_gone=lambda n: False, found_straggler=None)
    assert failure is not None and failure.kind == FailureKind.HANG
    assert (failure.ranks, failure.nodes) == ((0,), ("n0",))
    assert failure.evidence["stale_ranks"] == [1] and failure.evidence["waiting_in_collective"] == [1]


def test_a_hang_without_reports_from_every_rank_falls_back_to_who_stopped_first():
    """A rank that has not reported a position yet (no marker): the stale rank furthest behind."""
    attempt = Attempt(rank_node={0: "n0", 1: "n1"}, stepped={0, 1}, markers={1: (3, 1)})
    status = GroupStatus({0: RankStatus(0, "running", since_progress_s=9.0, stepped=True, step=2),
                          1: RankStatus(1, "running", since_progress_s=5.0, stepped=True, step=3)})
    failure = detect(status, 100.0, attempt, ControllerOptions(hang_timeout_s=4.0), 3,
                     node_gone=lambda n: False, found_straggler=None)
    assert failure is not None and failure.ranks == (0,)
    assert "waiting_in_collective" not in failure.evidence
