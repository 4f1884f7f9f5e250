"""An attached job: one whose controller this scheduler polls, and the GPUs it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from service.scheduler.observer import JobMetrics
from workers.client import ControllerClient, ControllerState

# Controller states in which a job has not yet reserved its GPUs: while one exists, no other job is
# started, so that two controllers never race for the same free GPUs.
_UNPLACED = frozenset({ControllerState.INIT, ControllerState.PLACING})


@dataclasses.dataclass
class Attached:
    """A job whose controller this scheduler polls."""

    job_id: str
    controller: ControllerClient
    seq: int  # last controller event seq stored
    intended: dict[str, int]  # node name -> GPUs the scheduler planned for it (until the actual is known)
    metrics: JobMetrics
    controller_state: ControllerState = ControllerState.INIT
    placement: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    cancel_sent: bool = False
    poll_errors: int = 0

    def gpus_by_node(self) -> dict[str, int]:
        if self.controller_state == ControllerState.WAITING:
            return {}
        if self.placement:
            out: dict[str, int] = {}
            for r in self.placement:
                out[r["node_name"]] = out.get(r["node_name"], 0) + 1
            return out
        return dict(self.intended)

    @property
    def reserving(self) -> bool:
        """True while the job's controller has not reserved its GPUs yet."""
        return self.controller_state in _UNPLACED


def held_gpus(attached: Iterable[Attached]) -> dict[str, int]:
    """Node name -> GPUs the attached jobs hold or are about to reserve."""
    held: dict[str, int] = {}
    for a in attached:
        for node, n in a.gpus_by_node().items():
            held[node] = held.get(node, 0) + n
    return held
