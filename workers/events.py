"""The event protocol between ranks, the job controller and the service: kinds and payloads.

Two streams use it:

- rank -> controller: a rank actor buffers `RankEvent`s (`kind`, `rank`, `t` and a payload such as
  `StepReport`); the controller drains them with `poll()` or receives them through `report()`.
- controller -> service: the controller's event log, one JSON-ready dict per event
  (`event_record`): `seq`, `ts`, `kind`, `message`, `state`, then the payload's keys. The service
  stores these dicts as they are, so their shape is a schema: change it with a migration in mind.

`EventKind` is a `str` enum: a member compares equal to its string value and `json.dumps` writes
the value, but the dicts that cross a process boundary always carry the plain string
(`EventKind.X.value`), so that nothing downstream depends on this module to read them.

This module is a leaf: it imports nothing from `workers`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict


class EventKind(enum.StrEnum):
    """Every kind of event a rank or the controller reports."""

    # ---- the controller's log (what the service stores) ------------------------------------------
    CONTROLLER_STARTED = "controller_started"
    STATE = "state"  # a state transition (from_state, to_state)
    PLACED = "placed"
    PLACEMENT_FAILED = "placement_failed"
    PLACEMENT_MISMATCH = "placement_mismatch"  # a rank landed elsewhere than planned
    REPLANNED = "replanned"
    RENDEZVOUS = "rendezvous"  # the process group is up
    CHECKPOINT_SAVED = "checkpoint_saved"  # every rank committed its part
    CHECKPOINT_VERIFIED = "checkpoint_verified"  # the committed checkpoint matches its manifest
    FAULT_NOTE = "fault_note"  # a fault carried out differently than asked (no cluster owner)
    # A gradient check fired and the re-run reproduced it exactly: the data's spike, training went on.
    GRADIENT_SPIKE = "gradient_spike"
    # A restart re-ran a step whose gradient spike failed an earlier attempt with no snapshot to
    # re-run it (training.integrity.settle): same norms, the data's; changed, a transient fault then.
    GRADIENT_RERUN = "gradient_rerun"
    FAILURE = "failure"  # detection
    ATTRIBUTED = "attributed"  # the ranks / nodes / checkpoint at fault
    STRAGGLER = "straggler"  # a straggler reported without a restart
    NODE_SUSPECT = "node_suspect"
    NODE_QUARANTINED = "node_quarantined"
    NODE_DEAD = "node_dead"
    REFEREE_STARTED = "referee_started"
    REFEREE = "referee"
    REFEREE_INCONCLUSIVE = "referee_inconclusive"
    RESTART = "restart"
    FAST_PATH_FAILED = "fast_path_failed"
    RESTORE = "restore"  # the verified checkpoint a restart resumed from, and the steps lost
    RESUMED = "resumed"  # the first step after a recovery
    CANCELLED = "cancelled"
    PREEMPTION_REQUESTED = "preemption_requested"  # a notice: checkpoint at the next step, then stop
    PREEMPTED = "preempted"  # stopped after a preemption notice: step, restore_step, steps_lost
    ERROR = "error"
    JOB_ERROR = "job_error"  # the failure is the job's own (bad spec or data, reproduced): no node blamed
    MEMORY = "memory"  # every rank's memory account of its first step (training.parallel.memory), per term
    # ---- reported by ranks, and by the controller too -------------------------------------------
    STARTED = "started"  # rank: its process group is up; controller: the ranks of an attempt started
    FINISHED = "finished"
    INTEGRITY_ERROR = "integrity_error"
    FAULT_INJECTED = "fault_injected"
    VALIDATION = "validation"  # the held-out loss after a step (data.validation): step, loss
    # ---- reported by ranks only -----------------------------------------------------------------
    STEP = "step"
    COLLECTIVE = "collective"  # the rank entered the step's control collective (or a checkpoint's)
    CHECKPOINT = "checkpoint"  # the rank committed its part of a checkpoint
    VERIFIED = "verified"  # the integrity checks of a checkpointed step passed
    RESTORED = "restored"  # the rank restored a checkpoint (step None: none found)
    FAULT_FAILED = "fault_failed"  # a controller-side fault could not be carried out
    FAILED = "failed"  # the rank's training raised


# The node health a ledger change is reported as.
NODE_HEALTH_EVENT: dict[str, EventKind] = {
    "suspect": EventKind.NODE_SUSPECT,
    "quarantined": EventKind.NODE_QUARANTINED,
    "dead": EventKind.NODE_DEAD,
}


def parse_kind(value: Any) -> EventKind | None:
    """The EventKind of a reported `kind` value, or None for one this protocol does not know."""
    try:
        return EventKind(value)
    except ValueError:
        return None


# ---- rank -> controller -------------------------------------------------------------------------


class RankEvent(TypedDict, total=False):
    """What every rank event carries; the payload's keys follow."""

    kind: str  # an EventKind value
    rank: int
    t: float  # the rank's wall clock


class StepReport(TypedDict, total=False):
    """`step`: the engine's step info (training.train) and the rank's DP coordinate."""

    step: int
    loss: float
    tokens_per_s: float
    mfu: float | None
    step_time_s: float
    data_positions: list[int]
    dp: int


class CollectiveReport(TypedDict):
    step: int
    name: str  # "step" or "checkpoint"


class CheckpointReport(TypedDict):
    step: int
    path: str
    bytes: int
    seconds: float


class IntegrityErrorReport(TypedDict):
    error_kind: str
    step: int | None
    ranks: list[int]
    evidence: Any
    message: str


class FaultReport(TypedDict):
    fault: str  # a workers.faults kind
    step: Any
    phase: str
    t_fault: float
    seconds: NotRequired[float]  # slow_rank
    target: NotRequired[str]  # bitflip
    name: NotRequired[str]
    index: NotRequired[int]
    bit: NotRequired[int]


def rank_event(kind: EventKind, rank: int, t: float, payload: Mapping[str, Any]) -> dict[str, Any]:
    """A rank event as it travels to the controller (a plain dict, `kind` a plain string)."""
    return {"kind": kind.value, "rank": rank, "t": t, **payload}


def plain(value: Any) -> Any:
    """Dataclasses / objects from the engine -> JSON-friendly dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "item"):  # a 0-d tensor
        try:
            return plain(value.item())
        except Exception:  # noqa: BLE001 - any failure of .item() falls through to the generic forms
            pass
    if hasattr(value, "__dict__"):
        return {k: plain(v) for k, v in vars(value).items() if not k.startswith("_")}
    return str(value)


# ---- controller -> service ----------------------------------------------------------------------


class Payload:
    """A typed payload of a controller event; its fields become the event's keys, in order."""

    def to_dict(self) -> dict[str, Any]:
        assert dataclasses.is_dataclass(self)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class StateChange(Payload):
    from_state: str
    to_state: str


@dataclass(frozen=True)
class Placed(Payload):
    placement: list[dict[str, Any]]
    notes: list[str]


@dataclass(frozen=True)
class CheckpointSaved(Payload):
    step: int
    path: Any
    bytes: Any
    seconds: Any
    verified: bool


@dataclass(frozen=True)
class FailureReport(Payload):
    failure: dict[str, Any]  # workers.policies.Failure.to_dict()
    detected_by: str
    time_to_detect_s: float | None


@dataclass(frozen=True)
class Attribution(Payload):
    ranks: list[int]
    nodes: list[str]
    cause: str
    evidence: dict[str, Any]
    transient: Any


@dataclass(frozen=True)
class NodeHealthChange(Payload):
    node: str
    health: str
    faults: int
    cause: str


@dataclass(frozen=True)
class Restart(Payload):
    path: str  # "peer" (state from DP peers, no rollback), "fast" (only the failed ranks replaced) or "full"
    restarts: int
    cause: str
    restore_step: int
    restore_steps: list[int]
    exclude_nodes: list[str]
    replaced: list[int] | None = None  # fast path only
    placement: list[dict[str, Any]] | None = None  # fast path only
    # Why the peer path was or was not taken, and (peer) lost rank -> the survivor that sent its state
    recovery: dict[str, Any] | None = None
    spare_used: bool | None = None  # a replaced rank got a warm spare (workers.spares); fast/peer only
    replacement_s: float | None = None  # request to a warm replacement actor, the slowest rank's
    # the replacements that were not spares started in warm processes (workers.warm_workers)
    warm_process: bool | None = None
    evicted: list[int] | None = None  # survivors on a quarantined node, replaced with the lost ranks

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path}
        if self.replaced is not None:
            out["replaced"] = self.replaced
        if self.placement is not None:
            out["placement"] = self.placement
        out.update(restarts=self.restarts, cause=self.cause, restore_step=self.restore_step,
                   restore_steps=self.restore_steps, exclude_nodes=self.exclude_nodes)
        if self.recovery is not None:
            out["recovery"] = self.recovery
        if self.spare_used is not None:
            out.update(spare_used=self.spare_used, replacement_s=self.replacement_s)
        if self.warm_process is not None:
            out["warm_process"] = self.warm_process
        if self.evicted:
            out["evicted"] = self.evicted
        return out


@dataclass(frozen=True)
class Event:
    """One entry of the controller's event log before it is numbered."""

    kind: EventKind
    message: str
    payload: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, kind: EventKind, message: str, payload: Payload | None = None, **data: Any) -> Event:
        return cls(kind, message, {**(payload.to_dict() if payload else {}), **data})


def event_record(seq: int, ts: float, state: str, event: Event) -> dict[str, Any]:
    """The JSON-ready dict the service stores: seq, ts, kind (plain string), message, state, payload."""
    return {"seq": seq, "ts": ts, "kind": event.kind.value, "message": event.message, "state": state,
            **event.payload}
