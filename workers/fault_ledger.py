"""What the controller remembers about faults, as pure bookkeeping without Ray:

- `NodeLedger`: faults per node and the jobs they came from; suspect after a fault, quarantined
  after a confirmed SDC, or after `quarantine_after` faults from at least `min_jobs` different
  jobs (one job's faults never quarantine a node under the defaults), dead when the node left.
- `CheckpointLedger`: committed checkpoints, the steps whose integrity checks passed (verified),
  the ones whose manifest did not verify; only verified, undamaged checkpoints are restored. It
  is kept beside the checkpoints (`lattice-verified.json`) so a new controller knows it too.
- `DataLedger`: the data positions of the steps that count (a restore drops the steps after it),
  to show that no sample was skipped or repeated.
- `StragglerWatch`: who arrives last at each step's control collective, and by how much.
- `FaultClock`: fault -> detection -> first step after resume, for the time-to-detect and
  time-to-recover histograms, steps lost, and goodput.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LEDGER_FILE = "lattice-verified.json"


@dataclass
class NodeLedger:
    quarantine_after: int = 3
    min_jobs: int = 2  # a count-based quarantine needs faults from this many different jobs
    faults: dict[str, int] = field(default_factory=dict)
    health: dict[str, str] = field(default_factory=dict)  # node -> suspect | quarantined | dead
    fault_jobs: dict[str, set[str]] = field(default_factory=dict)  # node -> jobs whose faults counted

    def record(self, node: str, *, job: str = "", quarantine: bool = False, dead: bool = False) -> str | None:
        """Count a fault of `job` on `node`; returns its new health if it changed. `quarantine`:
        a confirmed hardware signal (an SDC settled by a vote or a referee)."""
        self.faults[node] = self.faults.get(node, 0) + 1
        jobs = self.fault_jobs.setdefault(node, set())
        jobs.add(job)
        old = self.health.get(node, "ready")
        if dead:
            new = "dead"
        elif old in ("quarantined", "dead"):
            new = old
        elif quarantine or self.over_threshold(node):
            new = "quarantined"
        else:
            new = "suspect"
        self.health[node] = new
        return new if new != old else None

    def over_threshold(self, node: str) -> bool:
        """`quarantine_after` faults or more, from at least `min_jobs` different jobs."""
        jobs = self.fault_jobs.get(node, set())
        return self.faults.get(node, 0) >= self.quarantine_after and len(jobs) >= self.min_jobs

    def in_state(self, *states: str) -> set[str]:
        return {n for n, h in self.health.items() if h in states}


@dataclass
class CheckpointLedger:
    root: str | None = None
    verified: set[int] = field(default_factory=set)  # steps whose integrity checks all passed
    committed: dict[int, str] = field(default_factory=dict)  # step -> path, committed by every rank
    corrupt: dict[int, str] = field(default_factory=dict)  # step -> why its manifest does not verify
    known: bool = False  # False until a ledger was found or this controller saw a step verified

    def load(self) -> None:
        if not self.root:
            return
        path = Path(self.root) / LEDGER_FILE
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable %s: %s", path, e)
            return
        self.verified = {int(s) for s in doc.get("verified", [])}
        self.corrupt = {int(k): str(v) for k, v in (doc.get("corrupt") or {}).items()}
        self.known = True

    def save(self) -> None:
        if not self.root:
            return
        path = Path(self.root)
        try:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / f".{LEDGER_FILE}.tmp"
            tmp.write_text(json.dumps({"verified": sorted(self.verified),
                                       "corrupt": {str(k): v for k, v in sorted(self.corrupt.items())}}))
            os.replace(tmp, path / LEDGER_FILE)
        except OSError as e:
            log.warning("could not write the checkpoint ledger under %s: %s", path, e)

    def mark_verified(self, step: int) -> None:
        if step not in self.verified:
            self.verified.add(step)
            self.known = True
            self.save()

    def mark_corrupt(self, step: int, why: str) -> None:
        self.corrupt[step] = why
        self.save()

    def restore_steps(self) -> set[int] | None:
        """Steps a restart may restore (None: no ledger yet, any valid checkpoint)."""
        if not self.known:
            return None
        return self.verified - set(self.corrupt)

    def expected_restore(self) -> int:
        """The step a restart will resume from (0: from scratch)."""
        allowed = self.restore_steps()
        steps = [s for s in self.committed if s not in self.corrupt and (allowed is None or s in allowed)]
        return max(steps, default=0)


@dataclass
class DataLedger:
    """Per step and DP rank, the global sample indices trained on (from the ranks' step reports)."""

    by_step: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    step_time: dict[int, float] = field(default_factory=dict)
    filled: set[int] = field(default_factory=set)  # steps completed from a restored checkpoint

    def record(
        self, step: int, positions: Iterable[int], step_time_s: float | None, dp_rank: int = 0
    ) -> None:
        self.by_step.setdefault(step, {}).setdefault(dp_rank, set()).update(int(p) for p in positions)
        if step_time_s is not None:
            self.step_time[step] = float(step_time_s)

    def rollback(self, to_step: int) -> int:
        """Forget the steps after `to_step` (a restore re-runs them); returns how many."""
        lost = [s for s in self.by_step if s > to_step]
        for s in lost:
            self.by_step.pop(s, None)
            self.step_time.pop(s, None)
            self.filled.discard(s)
        return len(lost)

    def fill(self, to_step: int, dp_size: int, positions: Callable[[int, int], list[int]]) -> list[int]:
        """Steps up to a restored checkpoint were trained by every rank (the checkpoint was committed
        by all of them after those steps), but a rank that died may have taken its last reports
        with it: complete those from the data source's positions. Returns the steps completed."""
        done = []
        for step in range(1, to_step + 1):
            row = self.by_step.setdefault(step, {})
            missing = [r for r in range(dp_size) if r not in row]
            for r in missing:
                row[r] = set(positions(step, r))
            if missing:
                self.filled.add(step)
                done.append(step)
        return done

    def useful_seconds(self) -> float:
        return sum(self.step_time.values())

    def summary(self, detail_limit: int = 100_000) -> dict[str, Any]:
        steps = sorted(self.by_step)
        every = [p for s in steps for r in sorted(self.by_step[s]) for p in sorted(self.by_step[s][r])]
        unique = set(every)
        out: dict[str, Any] = {"steps": steps, "samples": len(every), "repeated": len(every) - len(unique),
                               "filled_from_checkpoint": sorted(self.filled)}
        lo, hi = (min(unique), max(unique)) if unique else (0, -1)
        out["skipped"] = (hi - lo + 1) - len(unique)
        if len(every) <= detail_limit:
            out["by_step"] = [sorted(p for r in self.by_step[s].values() for p in r) for s in steps]
        return out


@dataclass
class StragglerWatch:
    """A rank that reaches the step's control collective last by more than `min_lag_s` and more
    than `factor` x the median step time, `steps` steps in a row, is a straggler."""

    min_lag_s: float = 1.0
    factor: float = 2.0
    steps: int = 3
    world: int = 0
    arrivals: dict[int, dict[int, float]] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    streak: tuple[int | None, int] = (None, 0)
    lags: list[tuple[int, int, float]] = field(default_factory=list)

    def reset(self, world: int) -> None:
        self.world, self.arrivals, self.streak, self.lags = world, {}, (None, 0), []

    def typical_step_s(self) -> float:
        """The median of rank 0's last 20 step times (0 before the first)."""
        return statistics.median(self.step_times[-20:]) if self.step_times else 0.0

    def arrive(self, step: int, rank: int, t: float) -> dict[str, Any] | None:
        row = self.arrivals.setdefault(step, {})
        row[rank] = t
        if len(row) < self.world:
            return None
        del self.arrivals[step]
        for old in [s for s in self.arrivals if s < step]:
            del self.arrivals[old]
        last = max(row, key=row.__getitem__)
        lag = row[last] - min(row.values())
        median = self.typical_step_s()
        if lag > max(self.min_lag_s, self.factor * median):
            rank, count = self.streak
            self.streak = (last, count + 1 if rank == last else 1)
            self.lags.append((step, last, lag))
        else:
            self.streak = (None, 0)
            return None
        rank, count = self.streak
        if count >= self.steps:
            recent = [{"step": s, "rank": r, "lag_s": round(x, 3)} for s, r, x in self.lags[-count:]]
            self.streak = (None, 0)
            return {"rank": rank, "lags": recent, "median_step_time_s": median,
                    "threshold_s": max(self.min_lag_s, self.factor * median)}
        return None


@dataclass
class FaultClock:
    """Wall-clock marks of the current incident and the totals the service turns into metrics."""

    fault_t: float | None = None  # when the (injected) fault fired
    detect_t: float | None = None
    cause: str | None = None
    incidents: list[dict[str, Any]] = field(default_factory=list)
    restarts_by_cause: dict[str, int] = field(default_factory=dict)
    steps_lost: int = 0
    sdc_detections: int = 0

    def fault(self, t: float) -> None:
        if self.fault_t is None or self.detect_t is not None:
            self.fault_t, self.detect_t = t, None

    def detected(self, cause: str, t: float) -> dict[str, Any]:
        self.detect_t, self.cause = t, cause
        incident: dict[str, Any] = {"cause": cause, "detected_at": t, "time_to_detect_s": None,
                                    "time_to_recover_s": None, "steps_lost": 0, "path": None}
        if self.fault_t is not None and self.fault_t <= t:
            incident["time_to_detect_s"] = round(t - self.fault_t, 3)
        self.incidents.append(incident)
        if cause == "sdc":
            self.sdc_detections += 1
        return incident

    def note(self, cause: str, t: float, time_to_detect_s: float | None) -> dict[str, Any]:
        """An incident that needs no restart (a damaged checkpoint): recorded, recovered at once."""
        incident = {"cause": cause, "detected_at": t, "path": None, "steps_lost": 0, "time_to_recover_s": 0.0,
                    "time_to_detect_s": None if time_to_detect_s is None else round(time_to_detect_s, 3)}
        self.incidents.insert(max(len(self.incidents) - (1 if self.recovering else 0), 0), incident)
        return incident

    def restarted(self, cause: str, path: str) -> None:
        self.restarts_by_cause[cause] = self.restarts_by_cause.get(cause, 0) + 1
        if self.incidents:
            self.incidents[-1]["path"] = path

    def lost(self, steps: int) -> None:
        self.steps_lost += steps
        if self.incidents:
            self.incidents[-1]["steps_lost"] += steps

    def resumed(self, t: float) -> float | None:
        """The first step after a recovery; returns the time to recover."""
        if self.detect_t is None or not self.incidents or self.incidents[-1]["time_to_recover_s"] is not None:
            return None
        took = round(max(t - self.detect_t, 0.0), 3)
        self.incidents[-1]["time_to_recover_s"] = took
        self.fault_t = self.detect_t = None
        return took

    @property
    def recovering(self) -> bool:
        return self.detect_t is not None
