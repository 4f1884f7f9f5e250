"""A checkpoint the job's own retention pruned before the controller got to check it (a loaded
controller lags behind its ranks) is gone, not damaged: no failure, no incident, never restored.
One whose directory is still there but fails its manifest is damage, as before."""

from __future__ import annotations

import time
from pathlib import Path

from workers.controller.eventlog import EventLog
from workers.controller.scrub import CheckpointScrubber, LocalCheckpointOps
from workers.fault_ledger import CheckpointLedger, FaultClock


def _scrubber() -> tuple[CheckpointScrubber, EventLog, FaultClock, list[int]]:
    events = EventLog(0, 100, time.time, lambda: "RUNNING")
    clock, asked = FaultClock(), []
    scrubber = CheckpointScrubber(CheckpointLedger(), LocalCheckpointOps(), events, clock, time.time,
                                  on_damaged=lambda: asked.append(1))
    return scrubber, events, clock, asked


def test_a_pruned_checkpoint_is_dropped_without_an_incident(tmp_path: Path) -> None:
    scrubber, events, clock, asked = _scrubber()
    scrubber.committed(5, str(tmp_path / "step-5"))  # committed, then pruned before the check
    assert 5 not in scrubber.ledger.committed and 5 not in scrubber.ledger.corrupt
    assert scrubber.expected_restore() == 0
    assert events.since(0) == [] and clock.incidents == [] and asked == []


def test_a_checkpoint_whose_directory_remains_but_fails_its_manifest_is_damage(tmp_path: Path) -> None:
    scrubber, events, clock, asked = _scrubber()
    (tmp_path / "step-5").mkdir()  # never committed: no manifest
    scrubber.committed(5, str(tmp_path / "step-5"))
    assert 5 in scrubber.ledger.corrupt and asked == [1]
    assert [e["kind"] for e in events.since(0)] == ["failure", "attributed"]
    assert [i["cause"] for i in clock.incidents] == ["checkpoint"]
