"""The ranks of one job as a group: the interface the controller drives.

`WorkerGroup` is what the controller's state machine talks to (after Ray Train v2): read the
topology, gang-reserve a placement, start the ranks, poll them, replace lost ones, shut them down.
Tests drive the state machine against a dummy implementation one transition at a time;
`workers.worker_group.RayWorkerGroup` is the real one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.config.run import RunConfig
from workers.placement import Placement, RankPlacement
from workers.recovery_path import RecoveryPath
from workers.topology import Topology

# idle/running/finished/failed come from the actor; dead/unresponsive from the group's view of it.
RANK_STATES = ("idle", "running", "finished", "failed", "dead", "unresponsive")


class WorkerGroupError(RuntimeError):
    pass


class WorkerGroupStartupError(WorkerGroupError):
    """Rank actors could not be created, did not report in, or the rendezvous failed."""


@dataclass
class RankStatus:
    rank: int
    state: str
    events: list[dict[str, Any]] = field(default_factory=list)
    since_progress_s: float = 0.0  # seconds since the rank's training thread last made progress
    stepped: bool = False  # has completed at least one step in this attempt
    step: int | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    dropped: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankStatus:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class GroupStatus:
    ranks: dict[int, RankStatus]

    def in_state(self, *states: str) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.state in states)

    @property
    def all_finished(self) -> bool:
        return bool(self.ranks) and all(s.state == "finished" for s in self.ranks.values())


class WorkerGroup(ABC):
    """What the controller needs from 'the ranks of this job'."""

    @abstractmethod
    def topology(self, health: Mapping[str, str], cordoned: Collection[str]) -> Topology:
        """The cluster now, with the given health ledger merged in."""

    @abstractmethod
    def reserve(self, placement: Placement) -> None:
        """Gang-reserve every rank's GPU; raises PlacementError (ReservationTimeout) if not granted."""

    @abstractmethod
    def start(
        self, run_cfg: RunConfig, *, resume: bool, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
    ) -> list[RankPlacement]:
        """Create the ranks in the reservation, rendezvous, launch training. Returns where each
        rank really runs. `faults` ({"kind", "rank", "at_step", ...}) are armed before training
        starts (fault injection); `restore_steps` limits the checkpoints the ranks may resume
        from (the verified ones; None = any valid one); `rerun_spikes` are the gradient spikes a
        failed attempt saw un-re-run (training.hooks.TrainHooks.rerun_spikes). Raises
        WorkerGroupStartupError."""

    @abstractmethod
    def poll(self) -> GroupStatus:
        """Events since the last poll and a heartbeat from every rank."""

    @abstractmethod
    def shutdown(self) -> None:
        """End the ranks and release the reservation; idempotent."""

    def close(self) -> None:
        """The job is over (after `shutdown`): let go of what was kept for its restarts, such as
        warm worker processes. Default: nothing kept."""
        return None

    def inject_fault(self, kind: str, rank: int, at_step: int, **params: Any) -> None:
        """Schedule a rank-level fault (fault injection). Optional for implementations."""
        raise NotImplementedError(f"{type(self).__name__} does not inject faults")

    #: The path the last `replace_ranks` took (peer or checkpoint) and why (workers.recovery_path).
    last_recovery: RecoveryPath | None = None

    def replace_ranks(
        self, ranks: Sequence[int], run_cfg: RunConfig, *, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None, allow_peer: bool = True,
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
        avoid_nodes: Collection[str] = (), prefer_avoid: Collection[str] = (),
    ) -> list[RankPlacement]:
        """The recovery fast path: keep the other ranks' processes, start new ones for `ranks` in their
        reservation slots, rendezvous again on a new port and resume everyone, from the DP peers'
        memory when they can (`allow_peer`), else the checkpoint; `last_recovery` says which. Raises
        WorkerGroupError when it cannot (the caller falls back to a full restart)."""
        raise WorkerGroupError(f"{type(self).__name__} cannot replace single ranks")

    def kill_ranks_on_node(self, node_name: str) -> list[int]:
        """End every rank process on `node_name` (a node death without a cluster to remove it from)."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill ranks")

    def node_alive(self, node_name: str) -> bool:
        """Does the cluster still see this node alive (default: assume so)?"""
        return True

    def request_action(self, action: str) -> None:  # noqa: B027 - an optional hook that may do nothing
        """Ask every rank for 'checkpoint' / 'stop' / 'checkpoint_and_stop' at the next step."""

    def dump_collectives(self) -> None:  # noqa: B027 - an optional hook that may do nothing
        """Ask every live rank to write its flight recorder into the job's folder
        (workers.collective_trace)."""

    def describe_spares(self) -> list[dict[str, Any]]:
        """The job's hot spares (workers.spares): job, node, rack, state, age_s."""
        return []

    def describe_warm(self) -> dict[str, int]:
        """Node id -> the job's warm worker processes there, as last counted (workers.warm_workers)."""
        return {}

    def replacement_info(self) -> dict[str, Any]:
        """How the last `replace_ranks` got its actors (workers.spares.JobSpares.replacement_info)."""
        return {}
