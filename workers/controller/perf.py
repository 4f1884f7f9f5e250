"""The measured side of "predicted vs measured": rank 0's step times and per-phase timers
(training.phase_timer), kept by the controller across attempts and summarised into the job's
progress (`progress["perf"]`), which the service compares with the plan (service.performance).

The first WARMUP_STEPS steps of every attempt are left out (allocator warm-up, first collectives,
lazy initialisation); the summary is the median of the rest, over the last MAX_STEPS of them.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WARMUP_STEPS = 3
MAX_STEPS = 200


@dataclass
class StepPerf:
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))
    phases: deque[dict[str, float]] = field(default_factory=lambda: deque(maxlen=MAX_STEPS))
    seen: int = 0  # steps reported, warm-up included

    def record(self, step_in_attempt: int, step_time_s: float, phases: Mapping[str, Any] | None) -> bool:
        """One step of rank 0 (`step_in_attempt` counts from 1 in each attempt); False while warming up."""
        self.seen += 1
        if step_in_attempt <= WARMUP_STEPS:
            return False
        self.step_times.append(float(step_time_s))
        self.phases.append({str(k): float(v) for k, v in (phases or {}).items()
                            if isinstance(v, int | float) and not isinstance(v, bool)})
        return True

    def summary(self) -> dict[str, Any] | None:
        """The medians after warm-up (None before there is a step after warm-up)."""
        if not self.step_times:
            return None
        names = sorted({k for p in self.phases for k in p})
        phases = {k: statistics.median([p[k] for p in self.phases if k in p]) for k in names}
        return {"steps": len(self.step_times), "warmup_steps": WARMUP_STEPS, "source": "rank 0",
                "step_time_s": statistics.median(self.step_times), "phases_s": phases}
