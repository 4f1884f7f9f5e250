"""Pluggable decisions of the job controller (after Ray Train v2's FailurePolicy / ScalingPolicy).

The controller's state machine detects *what* happened; a policy decides *what to do*:

- `FailurePolicy.decide(failure, restarts)` -> `FailureDecision`: retry (restart the ranks
  from the last checkpoint, optionally avoiding nodes) or give up with a reason.
- `ScalingPolicy.on_unplaceable(...)` -> `ScalingDecision`: wait for capacity, re-plan the
  layout for what is left, or fail.

Issue 6 (fault tolerance) plugs in here: attribution-aware failure policies (quarantine a node
after a confirmed SDC or N faults, fast-path replacement of only the dead ranks) and a
replanning scaling policy backed by the service's planner, injected as a callable so that
`workers` never imports `service`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from training.layout import Layout
from workers.topology import Topology


class FailureKind(enum.StrEnum):
    RANK_DIED = "rank_died"  # the rank's actor/process is gone (ActorDiedError, SIGKILL)
    NODE_DIED = "node_died"  # the node hosting ranks left the cluster
    RANK_ERROR = "rank_error"  # the training function raised
    HANG = "hang"  # no heartbeat/progress within the timeout
    STARTUP = "startup"  # actors could not be created or the rendezvous failed
    SDC = "sdc"  # silent data corruption (fingerprint mismatch, NaN/Inf, loss spike): issue 6
    CHECKPOINT = "checkpoint"  # a damaged / unverifiable checkpoint: issue 6


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()  # node names of the ranks at fault
    step: int | None = None
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "kind": str(self.kind), "message": self.message, "ranks": list(self.ranks),
            "nodes": list(self.nodes), "step": self.step, "evidence": dict(self.evidence),
        }


class FailureAction(enum.StrEnum):
    RETRY = "retry"
    RAISE = "raise"


@dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    reason: str
    exclude_nodes: tuple[str, ...] = ()  # avoid these nodes when placing the restart
    suspect_nodes: tuple[str, ...] = ()  # mark these nodes suspect in the health overlay
    quarantine_nodes: tuple[str, ...] = ()  # never use these nodes again (issue 6 ledger)


class FailurePolicy(ABC):
    @abstractmethod
    def decide(self, failure: Failure, restarts: int) -> FailureDecision:
        """`restarts` is how many restarts the job has already used."""


@dataclass
class RestartPolicy(FailurePolicy):
    """Restart from the last checkpoint until `max_restarts` is spent. The nodes of the
    ranks at fault become suspect (placed last); with `avoid_failed_nodes` the restart is
    also kept off them when capacity allows."""

    max_restarts: int = 3
    avoid_failed_nodes: bool = False

    def decide(self, failure: Failure, restarts: int) -> FailureDecision:
        if restarts >= self.max_restarts:
            return FailureDecision(
                FailureAction.RAISE,
                f"restart budget spent ({restarts} of max_restarts={self.max_restarts}); "
                f"last failure: {failure.kind}: {failure.message}",
            )
        culprits = failure.nodes if failure.kind != FailureKind.STARTUP else ()
        return FailureDecision(
            FailureAction.RETRY,
            f"restart {restarts + 1} of {self.max_restarts} after {failure.kind}",
            exclude_nodes=failure.nodes if self.avoid_failed_nodes else (),
            suspect_nodes=culprits,
        )


class ScalingAction(enum.StrEnum):
    WAIT = "wait"
    REPLAN = "replan"
    FAIL = "fail"


@dataclass(frozen=True)
class ScalingDecision:
    action: ScalingAction
    reason: str
    retry_after_s: float = 2.0
    layout: Layout | None = None  # the new layout for REPLAN


class ScalingPolicy(ABC):
    @abstractmethod
    def on_unplaceable(
        self, reason: str, layout: Layout, topology: Topology, attempts: int, waited_s: float
    ) -> ScalingDecision:
        """The layout does not fit now (`reason` from placement); what to do."""


@dataclass
class HoldLayoutPolicy(ScalingPolicy):
    """Keep the planned layout and wait for capacity; fail after `max_wait_s` (None: never)."""

    retry_after_s: float = 2.0
    max_wait_s: float | None = None

    def on_unplaceable(
        self, reason: str, layout: Layout, topology: Topology, attempts: int, waited_s: float
    ) -> ScalingDecision:
        if self.max_wait_s is not None and waited_s >= self.max_wait_s:
            return ScalingDecision(
                ScalingAction.FAIL,
                f"no capacity for {waited_s:.0f}s (max_wait_s={self.max_wait_s}): {reason}",
            )
        return ScalingDecision(ScalingAction.WAIT, reason, retry_after_s=self.retry_after_s)


Replanner = Callable[[Topology, Layout], "Layout | None"]


@dataclass
class ReplanPolicy(ScalingPolicy):
    """Issue 6's 'replan when capacity is short': ask `replanner(topology, layout)` (the
    service's planner, injected) for a layout that fits what is left; wait when it has none.
    Re-sharding the checkpoint into the new layout is the training engine's (DCP by FQN)."""

    replanner: Replanner
    retry_after_s: float = 2.0
    max_wait_s: float | None = None
    wait_before_replan_s: float = 0.0  # give a lost node this long to come back first

    def on_unplaceable(
        self, reason: str, layout: Layout, topology: Topology, attempts: int, waited_s: float
    ) -> ScalingDecision:
        if waited_s >= self.wait_before_replan_s:
            new = self.replanner(topology, layout)
            if new is not None and new != layout:
                return ScalingDecision(
                    ScalingAction.REPLAN, f"replanned for the live cluster: {reason}", layout=new
                )
        if self.max_wait_s is not None and waited_s >= self.max_wait_s:
            return ScalingDecision(ScalingAction.FAIL, f"no capacity and no smaller layout: {reason}")
        return ScalingDecision(ScalingAction.WAIT, reason, retry_after_s=self.retry_after_s)
