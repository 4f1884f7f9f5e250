"""The small records the controller's state machine owns besides the attempt: what the service
sees of the job (`JobRecord`), the recovery under way (`Recovery`), the placement retry loop
(`PlacementRetry`), the clocks it reads (`Clocks`) and its fault-tolerance books (`FaultBooks`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.controller.perf import StepPerf
from workers.fault_ledger import DataLedger, FaultClock, NodeLedger, StragglerWatch
from workers.policies import Failure, FailurePolicy, ScalingPolicy


@dataclass
class JobRecord:
    """What the service reads in a snapshot besides the events."""

    progress: dict[str, Any]
    placement: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None
    reason: str | None = None  # why the job ended or waits
    traceback: str | None = None  # the failing rank's last traceback (bounded), once the job failed
    restarts: int = 0
    cancel_reason: str | None = None  # set by a cancel request, acted on by the loop
    perf: StepPerf = field(default_factory=StepPerf)  # measured step and phase times (progress["perf"])

    @classmethod
    def new(cls, total_steps: int) -> JobRecord:
        return cls(progress={"step": 0, "total_steps": total_steps, "loss": None, "tokens_per_s": None,
                             "mfu": None, "step_time_s": None, "last_checkpoint_step": None})


@dataclass
class Recovery:
    """The failure being recovered from and how."""

    resume: bool  # start from the last checkpoint (every start after the first does)
    failure: Failure | None = None
    fast_ranks: list[int] = field(default_factory=list)  # ranks the fast path replaces ([]: full restart)
    reached: int | None = None  # the step the job had reached when the failure was detected
    straggler: dict[str, Any] | None = None  # a straggler found, not yet handled
    peer_step: int | None = None  # the last restart came from the DP peers' state of this step...
    peer_failed: bool = False  # ...and that attempt failed before a step: use the checkpoint next
    # Gradient spikes seen with no snapshot to re-run them, step -> {rank: local norm}, in the layout
    # `rerun_layout`: the restarts re-run them (training.hooks.TrainHooks.rerun_spikes).
    rerun_spikes: dict[int, dict[int, float]] = field(default_factory=dict)
    rerun_nodes: dict[int, dict[int, str]] = field(default_factory=dict)  # ...and their ranks' nodes then
    rerun_layout: Any = None
    # Re-runs whose norms changed, (step, ranks), for the state machine to blame those nodes
    transients: list[tuple[int, list[int]]] = field(default_factory=list)

    def note_spike(self, step: int, norms: dict[int, float], nodes: dict[int, str], layout: Any) -> None:
        """A spike for the restarts to re-run; those of another layout are dropped."""
        if layout != self.rerun_layout:
            self.rerun_spikes, self.rerun_nodes, self.rerun_layout = {}, {}, layout
        self.rerun_spikes[step], self.rerun_nodes[step] = norms, nodes

    def spikes_to_rerun(self, layout: Any) -> dict[int, dict[int, float]]:
        """`rerun_spikes` for a start in `layout`: after a replan the ranks see other local gradients,
        whose norms say nothing about the first attempt's."""
        return self.rerun_spikes if layout == self.rerun_layout else {}


@dataclass
class PlacementRetry:
    """Placement attempts while the layout does not fit."""

    since: float | None = None
    attempts: int = 0
    retry_at: float = 0.0
    last_reason: str | None = None

    def placed(self) -> None:
        self.since, self.attempts, self.last_reason = None, 0, None


@dataclass(frozen=True)
class Clocks:
    monotonic: Callable[[], float] = time.monotonic  # timeouts
    wall: Callable[[], float] = time.time  # event timestamps, fault timing


@dataclass(frozen=True)
class Policies:
    failure: FailurePolicy
    scaling: ScalingPolicy


@dataclass
class FaultBooks:
    """The metrics side of fault tolerance: incidents, data positions, stragglers."""

    started_wall: float
    clock: FaultClock = field(default_factory=FaultClock)
    data: DataLedger = field(default_factory=DataLedger)
    straggler: StragglerWatch = field(default_factory=StragglerWatch)

    def stats(self, now_wall: float, nodes: NodeLedger) -> dict[str, Any]:
        """What the service turns into fault-tolerance metrics (restarts by cause, time to detect
        and to recover per incident, steps lost, goodput, SDC detections, node health)."""
        wall = max(now_wall - self.started_wall, 1e-9)
        return {
            "restarts_by_cause": dict(self.clock.restarts_by_cause),
            "incidents": [dict(i) for i in self.clock.incidents],
            "steps_lost": self.clock.steps_lost,
            "sdc_detections": self.clock.sdc_detections,
            "useful_step_seconds": round(self.data.useful_seconds(), 4),
            "wall_seconds": round(wall, 3),
            "goodput": round(min(self.data.useful_seconds() / wall, 1.0), 4),
            "node_health": dict(nodes.health),
            "node_faults": dict(nodes.faults),
        }
