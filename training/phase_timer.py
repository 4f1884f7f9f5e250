"""Cheap per-phase timers of one training step (what `lattice plan --explain-against` compares with
the plan's time terms).

The timer never adds a device synchronisation: on CPU (gloo) every op runs when it is called, so
`time.perf_counter` marks are the phase times; on CUDA a mark records a timing event on the current
stream (no host sync) and `read` takes the elapsed times once the step's own loss read-back
(`.item()` in the step summary) has waited for the stream. Numerics are untouched either way.
"""

from __future__ import annotations

import time

import torch

# Phases in the order a step runs them (training.train.Trainer.train_step).
PHASES = ("data", "compute", "integrity", "dp_sync", "optimizer", "summary")


class PhaseTimer:
    """Marks between the phases of one step; `read()` gives seconds per phase."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, float | torch.cuda.Event]] = []

    def _now(self) -> float | torch.cuda.Event:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("", self._now())]

    def mark(self, phase: str) -> None:
        """The phase `phase` ends now (and the next one begins)."""
        if self._marks:
            self._marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        """Seconds per phase of the last step (a phase marked twice adds up)."""
        out: dict[str, float] = {}
        if len(self._marks) < 2:
            return out
        if self.cuda:
            last = self._marks[-1][1]
            assert isinstance(last, torch.cuda.Event)
            last.synchronize()  # already complete: the step's loss read-back waited for the stream
        for (_, before), (phase, after) in zip(self._marks, self._marks[1:], strict=False):
            if isinstance(before, float) and isinstance(after, float):
                seconds = after - before
            else:
                assert isinstance(before, torch.cuda.Event) and isinstance(after, torch.cuda.Event)
                seconds = before.elapsed_time(after) / 1e3  # elapsed_time is in milliseconds
            out[phase] = out.get(phase, 0.0) + max(0.0, seconds)
        return out
