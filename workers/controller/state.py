"""The job controller's states, the transitions between them, and the job state each one shows.

    INIT -> PLACING -> STARTING -> RUNNING <-> CHECKPOINTING -> FINISHED
               |  ^                  |
               v  |                  v (failure: policy says retry)
             WAITING              RECOVERING -> PLACING ...
    any non-terminal state -> CANCELLED (cancel) | ERRORED (policy gives up, internal error)
                            | PREEMPTED (a preemption notice: the job goes back to the queue)

A leaf of `workers`: it imports nothing else from the package.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ControllerState(enum.StrEnum):
    INIT = "INIT"
    PLACING = "PLACING"
    WAITING = "WAITING"  # the layout does not fit now; placement is retried
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    RECOVERING = "RECOVERING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"  # stopped by a preemption notice; the service requeues the job

    @property
    def terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.ERRORED, ControllerState.CANCELLED,
                        ControllerState.PREEMPTED)

    @property
    def training(self) -> bool:
        """Ranks are training (so they can be handed faults and actions)."""
        return self in (ControllerState.RUNNING, ControllerState.CHECKPOINTING)


# The service's job states (ARCHITECTURE.md) for each controller state.
JOB_STATE: dict[ControllerState, str] = {
    ControllerState.INIT: "starting",
    ControllerState.PLACING: "starting",
    ControllerState.WAITING: "queued",
    ControllerState.STARTING: "starting",
    ControllerState.RUNNING: "running",
    ControllerState.CHECKPOINTING: "running",
    ControllerState.RECOVERING: "recovering",
    ControllerState.FINISHED: "succeeded",
    ControllerState.ERRORED: "failed",
    ControllerState.CANCELLED: "cancelled",
    ControllerState.PREEMPTED: "queued",  # back to the queue; it resumes from its checkpoint
}


@dataclass(frozen=True)
class Transition:
    from_state: ControllerState
    to_state: ControllerState
    reason: str
