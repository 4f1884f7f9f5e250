"""Fault injection bookkeeping: the faults still to fire, the ones that fired (heard once, whether
from the rank or directly), and the controller-side faults a rank triggers (kill_node through the
cluster owner, corrupt_checkpoint through the scrubber). Fault specs are workers.faults'."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from workers.controller.eventlog import EventLog
from workers.controller.scrub import CheckpointScrubber
from workers.events import EventKind
from workers.fault_ledger import FaultClock
from workers.faults import normalize_faults
from workers.worker_group import WorkerGroup

FaultKey = tuple[Any, int, Any, Any]  # (kind, rank, phase, step)


def kill_node(name: str) -> None:
    """Remove a node through the cluster owner's mailbox (workers.node_killer)."""
    from workers.node_killer import request_node_kill

    if not request_node_kill(name):
        raise RuntimeError("no cluster owner serves node kills")


class FaultInjector:
    def __init__(
        self,
        faults: Iterable[Mapping[str, Any]],
        worker_group: WorkerGroup,
        events: EventLog,
        fault_clock: FaultClock,
        scrubber: CheckpointScrubber,
        wall_clock: Callable[[], float],
        node_killer: Callable[[str], None] | None = None,
    ) -> None:
        """`node_killer(name)` removes a node from the cluster (kill_node faults)."""
        # Every fault is armed on a rank; kill_node and corrupt_checkpoint are triggered by one at
        # the exact step (`trigger`) and carried out here.
        self.pending: list[dict[str, Any]] = list(normalize_faults(list(faults)))
        self.dead_nodes: set[str] = set()  # nodes marked dead here, with no cluster owner to remove them
        self._fired: set[FaultKey] = set()
        self._wg = worker_group
        self._events = events
        self._fault_clock = fault_clock
        self._scrubber = scrubber
        self._wall = wall_clock
        self._node_killer = node_killer

    def add(self, fault: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a fault added while the job runs and keep it pending; returns the normalized spec."""
        (f,) = normalize_faults([dict(fault)])
        with self._events.lock:
            self.pending.append(f)
        return f

    def expire(self, reached: int) -> None:
        """A fault whose step the job passed has fired (a killed rank may not have said so)."""
        self.pending = [f for f in self.pending if int(f.get("at_step", 0)) > reached]

    def trigger(self, rank: int, fault: Mapping[str, Any], rank_node: Mapping[int, str]) -> str:
        """Carry out a controller-side fault rank `rank` reached (kill_node, corrupt_checkpoint)."""
        kind, step = fault.get("kind"), fault.get("step")
        with self._events.lock:
            self._drop_pending(kind, rank, step)
            self._fired.add((kind, rank, fault.get("phase", "step"), step))
        if kind == "corrupt_checkpoint":
            return self._scrubber.damage(step, str(fault.get("path") or ""), fault.get("which", "any"),
                                         fault.get("mode", "flip"), rank)
        if kind != "kill_node":
            raise ValueError(f"{kind} is not a controller-side fault")
        node = fault.get("node") or rank_node.get(rank)
        if not node:
            raise RuntimeError(f"kill_node: rank {rank}'s node is unknown")
        self._fault_clock.fault(self._wall())
        self._events.emit(EventKind.FAULT_INJECTED, f"kill_node: removing node {node} at step {step}",
                          fault=kind, node=node, step=step, phase=fault.get("phase", "step"), rank=rank)
        try:
            if self._node_killer is None:
                raise RuntimeError("no node killer")
            self._node_killer(node)
        except Exception as e:  # noqa: BLE001 - whatever stopped the owner, the node dies in simulation
            self.dead_nodes.add(node)
            killed = self._wg.kill_ranks_on_node(node)
            self._events.emit(EventKind.FAULT_NOTE, f"no cluster owner removed {node} ({e}); killed its "
                              f"ranks {killed} and marked it dead", node=node)
        return node

    def fired(self, rank: int, ev: Mapping[str, Any], node: str | None) -> None:
        """A rank reported a fault it carried out (once, even if heard twice)."""
        fault, at = ev.get("fault"), ev.get("step")
        key = (fault, rank, ev.get("phase", "step"), at)
        if key in self._fired:
            return  # the controller heard it directly before the rank died, then from the rank
        self._fired.add(key)
        self._drop_pending(fault, rank, at)
        self._fault_clock.fault(float(ev.get("t_fault") or ev.get("t") or self._wall()))
        extra = {k: ev[k] for k in ("target", "name", "index", "bit", "seconds", "phase") if k in ev}
        self._events.emit(EventKind.FAULT_INJECTED, f"{fault} on rank {rank} at step {at}",
                          rank=rank, node=node, fault=fault, step=at, **extra)

    def _drop_pending(self, kind: Any, rank: int, step: Any) -> None:
        """The earliest pending fault of this kind on this rank has fired."""
        for f in sorted(self.pending, key=lambda f: f["at_step"]):
            if f.get("kind") == kind and int(f.get("rank") or 0) == rank and (
                not isinstance(step, int) or f["at_step"] <= step
            ):
                self.pending.remove(f)
                return
