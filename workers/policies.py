"""Pluggable decisions of the job controller (after Ray Train v2's FailurePolicy / ScalingPolicy).

The controller's state machine detects *what* happened; a policy decides *what to do*:

- `FailurePolicy.decide(failure, restarts)` -> `FailureDecision`: retry (restart the ranks
  from the last checkpoint, optionally avoiding nodes) or give up with a reason.
- `ScalingPolicy.on_unplaceable(...)` -> `ScalingDecision`: wait for capacity, re-plan the
  layout for what is left, or fail.

Fault tolerance plugs in here too: class-aware failure policies (a job error fails at once
and blames nobody, an unknown failure restarts blaming nobody, an infrastructure fault restarts
and counts against its nodes; a confirmed SDC quarantines) and a
replanning scaling policy backed by the service's planner, injected as a callable so that
`workers` never imports `service`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from training.config.layout import Layout
from workers.topology import Topology


class FailureClass(enum.StrEnum):
    """What a failure says about its cause (workers.controller.classify decides it)."""

    JOB_ERROR = "job_error"  # bad spec or data, an exception or non-finite loss that reproduces
    INFRASTRUCTURE = "infrastructure"  # death, hang, straggler, collective timeout, SDC: blame the node
    UNKNOWN = "unknown"  # not known yet: restart within the budget and blame nobody


class FailureKind(enum.StrEnum):
    RANK_DIED = "rank_died"  # the rank's actor/process is gone (ActorDiedError, SIGKILL)
    NODE_DIED = "node_died"  # the node hosting ranks left the cluster
    RANK_ERROR = "rank_error"  # the training function raised
    HANG = "hang"  # no heartbeat/progress within the timeout
    STARTUP = "startup"  # actors could not be created or the rendezvous failed
    SDC = "sdc"  # silent data corruption (fingerprint mismatch, NaN/Inf, loss spike)
    CHECKPOINT = "checkpoint"  # a damaged / unverifiable checkpoint
    STRAGGLER = "straggler"  # a rank that keeps the others waiting at every step


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()  # node names of the ranks at fault
    step: int | None = None
    evidence: dict = field(default_factory=dict)
    classification: FailureClass | None = None  # None: the kind's default (`failure_class`)
    why: str = ""  # why it was classified so

    @property
    def failure_class(self) -> FailureClass:
        if self.classification is not None:
            return self.classification
        return FailureClass.UNKNOWN if self.kind == FailureKind.RANK_ERROR else FailureClass.INFRASTRUCTURE

    @property
    def blames_nodes(self) -> bool:
        return self.failure_class == FailureClass.INFRASTRUCTURE

    def to_dict(self) -> dict:
        return {
            "kind": str(self.kind), "message": self.message, "ranks": list(self.ranks),
            "nodes": list(self.nodes), "step": self.step, "evidence": dict(self.evidence),
            "classification": str(self.failure_class), "classification_reason": self.why,
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
    quarantine_nodes: tuple[str, ...] = ()  # never use these nodes again (the node ledger)


class FailurePolicy(ABC):
    @abstractmethod
    def decide(self, failure: Failure, restarts: int) -> FailureDecision:
        """`restarts` is how many restarts the job has already used."""


@dataclass
class RestartPolicy(FailurePolicy):
    """By the failure's class: a job error fails the job at once (no restart spent, no node
    blamed); an unknown failure restarts within the budget and blames nobody; an infrastructure
    fault restarts from the last checkpoint until `max_restarts` is spent, and the nodes of the
    ranks at fault become suspect (placed last); with `avoid_failed_nodes` the restart is
    also kept off them when capacity allows. A confirmed SDC (the engine named the culprit
    ranks, not every rank) quarantines their nodes (`quarantine_on_sdc`)."""

    max_restarts: int = 3
    avoid_failed_nodes: bool = False
    quarantine_on_sdc: bool = True

    def decide(self, failure: Failure, restarts: int) -> FailureDecision:
        cls = failure.failure_class
        if cls == FailureClass.JOB_ERROR:
            return FailureDecision(FailureAction.RAISE, failure.why or f"job error: {failure.message}")
        if restarts >= self.max_restarts:
            return FailureDecision(
                FailureAction.RAISE,
                f"restart budget spent ({restarts} of max_restarts={self.max_restarts}); "
                f"last failure: {failure.kind}: {failure.message}",
            )
        if cls == FailureClass.UNKNOWN:
            return FailureDecision(FailureAction.RETRY, f"restart {restarts + 1} of {self.max_restarts} "
                                   f"after {failure.kind} (unknown cause: no node blamed)")
        culprits = failure.nodes if failure.kind != FailureKind.STARTUP else ()
        confirmed = failure.kind == FailureKind.SDC and bool(failure.ranks) and _names_a_culprit(failure)
        quarantine = culprits if confirmed and self.quarantine_on_sdc else ()
        return FailureDecision(
            FailureAction.RETRY,
            f"restart {restarts + 1} of {self.max_restarts} after {failure.kind}",
            exclude_nodes=failure.nodes if self.avoid_failed_nodes or quarantine else (),
            suspect_nodes=tuple(n for n in culprits if n not in quarantine),
            quarantine_nodes=quarantine,
        )


def _names_a_culprit(failure: Failure) -> bool:
    """An SDC whose evidence singles out ranks: a majority vote, a re-run, or a rank-local check
    (every rank named means the check could not tell, e.g. a loss spike seen by all)."""
    ev = failure.evidence.get("evidence") or {}
    if ev.get("attribution") or ev.get("where") or ev.get("ambiguous") is False:
        return True
    world = failure.evidence.get("world_size")
    return world is not None and len(failure.ranks) < int(world)


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


def keep_global_batch(old: Layout, new: Layout) -> Layout:
    """`new` with gradient accumulation set so that its global batch is `old`'s, when it can be
    (the training mathematics then stay the same); otherwise `new` unchanged (the replanned event
    says that the global batch changed)."""
    import dataclasses

    if new.global_batch == old.global_batch:
        return new
    per_step = new.dp * new.micro_batch_size
    if old.global_batch % per_step == 0:
        try:
            return dataclasses.replace(new, num_microbatches=old.global_batch // per_step)
        except ValueError:
            return new
    return new


def keep_global_batch_replanner(topology: Topology, layout: Layout) -> Layout | None:
    """The fallback planner: the largest DP degree (a divisor of the current one) whose ranks fit
    the schedulable GPUs, with gradient accumulation raised so that the global batch (dp x
    micro_batch_size x num_microbatches) and so the training mathematics stay the same. HSDP keeps
    its shard groups where the new DP allows (Layout.with_dp)."""
    free = topology.gpus_schedulable
    per_replica = layout.world_size // layout.dp
    for dp in range(layout.dp - 1, 0, -1):
        if layout.dp % dp or dp * per_replica > free:
            continue
        try:
            accumulate = layout.num_microbatches * (layout.dp // dp)
            return layout.with_dp(dp, accumulate)
        except ValueError:
            continue
    return None


@dataclass
class ReplanPolicy(ScalingPolicy):
    """Replan when capacity is short: ask `replanner(topology, layout)` (the
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
                new = keep_global_batch(layout, new)
                return ScalingDecision(
                    ScalingAction.REPLAN, f"replanned for the live cluster: {reason}", layout=new
                )
        if self.max_wait_s is not None and waited_s >= self.max_wait_s:
            return ScalingDecision(ScalingAction.FAIL, f"no capacity and no smaller layout: {reason}")
        return ScalingDecision(ScalingAction.WAIT, reason, retry_after_s=self.retry_after_s)
