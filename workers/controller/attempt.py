"""What the controller knows about one attempt (one start of the ranks), replaced as a whole when
the ranks start again: where each rank runs, when it was last heard from, the checkpoint save under
way, each rank's last position in the step, and the integrity error the engine raised."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Attempt:
    rank_node: dict[int, str] = field(default_factory=dict)  # rank -> node name
    last_seen: dict[int, float] = field(default_factory=dict)  # rank -> when it last answered a poll
    stepped: set[int] = field(default_factory=set)  # ranks that completed a step in this attempt
    ckpt_saved: dict[int, set[int]] = field(default_factory=dict)  # step -> ranks that committed it
    ckpt_open: int | None = None  # step whose save is under way
    step: int = 0  # the last step reached in this attempt (steps only grow within one)
    integrity: dict[str, Any] | None = None  # the engine's integrity error, recorded once
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its `failed` report
    # rank -> (step, 0 stepped | 1 entered the step's collective | 2 entered a checkpoint's)
    markers: dict[int, tuple[int, int]] = field(default_factory=dict)
    failed_since: float | None = None  # ranks failed while others were unresponsive, since
    restored_seen: bool = False  # the ranks' restore has been accounted for
    restored: int = 0  # the step the ranks restored (0: from scratch)
    first_step: int | None = None  # the first step rank 0 reported in this attempt (perf warm-up)

    @classmethod
    def begin(cls, ranks: Collection[Any], now: float) -> Attempt:
        """A fresh attempt of `ranks` (RankPlacements: `rank`, `node_name`), all seen `now`."""
        return cls(rank_node={r.rank: r.node_name for r in ranks}, last_seen={r.rank: now for r in ranks})

    def nodes(self, ranks: Iterable[int]) -> tuple[str, ...]:
        """The sorted node names of `ranks` (the ones known)."""
        return tuple(sorted({self.rank_node[r] for r in ranks if r in self.rank_node}))
