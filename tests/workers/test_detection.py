"""Failure detection is pure (workers.controller.detection): what a poll of the ranks shows."""

from __future__ import annotations

from workers.controller.attempt import Attempt
from workers.controller.detection import death
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
