"""Checkpoint scrubbing: every committed checkpoint is checked against its manifest, and a damaged
one is recorded in the `CheckpointLedger` so that it is never restored. Also carries out the
corrupt_checkpoint fault, and holds the checkpoint operations on a filesystem the controller sees."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

from workers.controller.eventlog import EventLog
from workers.events import EventKind, FailureReport
from workers.fault_ledger import CheckpointLedger, FaultClock
from workers.policies import Failure, FailureKind

log = logging.getLogger(__name__)


class CheckpointOps(Protocol):
    def verify(self, path: str) -> None:
        """Raise if the checkpoint at `path` does not match its manifest."""

    def corrupt(self, path: str, which: str = "any", mode: str = "flip") -> str:
        """Damage one file of the checkpoint; returns what was damaged."""


class LocalCheckpointOps:
    """Verify / damage / list checkpoints on a filesystem this process sees."""

    def verify(self, path: str) -> None:
        from training.checkpoint.checkpointer import verify_checkpoint

        verify_checkpoint(path)

    def corrupt(self, path: str, which: str = "any", mode: str = "flip") -> str:
        from training.checkpoint.checkpointer import corrupt_checkpoint

        return corrupt_checkpoint(path, which, mode)

    def list(self, root: str) -> list[int]:
        from training.checkpoint.checkpointer import list_checkpoints

        return list_checkpoints(root)

    def gone(self, path: str) -> bool:
        """The checkpoint's directory is no longer there (the ranks' retention pruned it)."""
        return not os.path.lexists(path) and os.path.isdir(os.path.dirname(path.rstrip("/")))


class CheckpointScrubber:
    def __init__(
        self,
        ledger: CheckpointLedger,
        ops: CheckpointOps | None,
        events: EventLog,
        fault_clock: FaultClock,
        wall_clock: Callable[[], float],
        on_damaged: Callable[[], None],
    ) -> None:
        """`on_damaged()` runs when a committed checkpoint fails verification (the controller asks
        the ranks for a fresh one)."""
        self.ledger = ledger
        self.ops = ops
        self._events = events
        self._fault_clock = fault_clock
        self._wall = wall_clock
        self._on_damaged = on_damaged
        self._scrubbed: set[int] = set()
        self._damaged_at: dict[int, float] = {}  # step -> when a corrupt_checkpoint fault damaged it

    def committed(self, step: int, path: str) -> None:
        """Every rank committed the checkpoint of `step`: record it and check it."""
        self.ledger.committed[step] = path
        self.scrub(step, path)

    def scrub(self, step: int, path: str) -> bool:
        """Check a committed checkpoint against its manifest (once); False if it is damaged."""
        ops, ledger = self.ops, self.ledger
        if ops is None or not path or step in ledger.corrupt or step in self._scrubbed:
            return step not in ledger.corrupt
        self._scrubbed.add(step)
        try:
            ops.verify(path)
        except Exception as e:  # noqa: BLE001 - any verification failure makes the checkpoint unusable
            gone = getattr(ops, "gone", None)
            if gone is not None and gone(path):  # pruned by the job's retention before this check ran
                self.ledger.committed.pop(step, None)  # (a loaded controller lags): not damage, not usable
                log.info("checkpoint of step %d was pruned before it was scrubbed", step)
                return False
            self._damaged(step, path, str(e))
            return False
        self._events.emit(EventKind.CHECKPOINT_VERIFIED, f"checkpoint of step {step} verifies against its "
                          "manifest", step=step, verified=step in ledger.verified)
        return True

    def _damaged(self, step: int, path: str, why: str) -> None:
        self.ledger.mark_corrupt(step, why)
        now = self._wall()
        damaged_at = self._damaged_at.get(step)
        # Its own incident, which needs no restart (the checkpoint is simply never used); it leaves
        # a recovery in progress alone.
        incident = self._fault_clock.note("checkpoint", now, None if damaged_at is None else now - damaged_at)
        failure = Failure(FailureKind.CHECKPOINT, why, step=step, evidence={"path": path})
        self._events.emit(EventKind.FAILURE, f"checkpoint of step {step} does not verify: {why}",
                          FailureReport(failure.to_dict(), "manifest verification",
                                        incident["time_to_detect_s"]))
        self._events.emit(EventKind.ATTRIBUTED, f"checkpoint of step {step} is damaged; it will never be "
                          "restored", step=step, path=path, cause="checkpoint", evidence={"manifest": why})
        self._on_damaged()

    def scrub_on_disk(self, root: str | None) -> None:
        """Before a restart: verify every checkpoint on disk not checked yet (a rank that died may
        never have reported its part of a save, so its commit went unseen)."""
        ops = self.ops
        if ops is None or not root or not hasattr(ops, "list"):
            return
        for step in sorted(ops.list(root), reverse=True):
            self.ledger.committed.setdefault(step, f"{root}/step-{step}")
            self.scrub(step, self.ledger.committed[step])

    def damage(self, step: Any, path: str, which: str, mode: str, rank: int) -> str:
        """The corrupt_checkpoint fault: damage the checkpoint of `step` now."""
        self._damaged_at[int(step)] = self._wall()
        if self.ops is None or not path:
            raise RuntimeError("no checkpoint to damage")
        # Logged first: the loop thread may scrub this checkpoint as soon as it is damaged.
        self._events.emit(EventKind.FAULT_INJECTED, f"corrupt_checkpoint: damaging {which} of the checkpoint "
                          f"of step {step} ({mode})", fault="corrupt_checkpoint", step=step, path=path,
                          which=which, rank=rank)
        return self.ops.corrupt(path, which, mode)

    def expected_restore(self) -> int:
        return self.ledger.expected_restore()

    def stats(self) -> dict[str, Any]:
        return {"verified_steps": sorted(self.ledger.verified), "corrupt_steps": sorted(self.ledger.corrupt)}
