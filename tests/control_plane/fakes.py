"""A stand-in for the Ray side of the scheduler (workers.client): a fixed topology and job
controllers that live in a dict shared by every scheduler of the test, as named detached actors are
shared by every driver of a Ray cluster. Controllers never report progress (poll: busy)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import pytest

from workers.client import ControllerBusy, ControllerExists
from workers.topology import Topology


class FakeController:
    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.cancelled: str | None = None

    @property
    def name(self) -> str:
        return f"fake-controller-{self.job_id}"

    def poll(self, since_seq: int, timeout_s: float) -> dict[str, Any]:
        raise ControllerBusy(f"job {self.job_id}: the fake controller reports nothing")

    def responds(self, since_seq: int, timeout_s: float) -> bool:
        return True

    def cancel(self, reason: str) -> None:
        self.cancelled = reason

    def update_nodes(self, health: Mapping[str, str], cordoned: Collection[str]) -> None:
        return None

    def inject_fault(self, fault: Mapping[str, Any], timeout_s: float) -> None:
        return None


class FakeWorkers:
    """What service.scheduler.loop imports from workers.client, over one dict of controllers.
    `starts_file`: also append every start to this file (schedulers in other processes)."""

    def __init__(self, starts_file: Path | None = None, *, every_job_has_a_controller: bool = False) -> None:
        self.controllers: dict[str, FakeController] = {}
        self.starts: list[str] = []
        self.starts_file = starts_file
        self.every_job_has_a_controller = every_job_has_a_controller  # other processes started them

    def install(self, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        import service.scheduler.loop as loop

        for name in ("live_topology", "start_controller", "find_controller", "kill_controller",
                     "controller_job_ids"):
            if monkeypatch is not None:
                monkeypatch.setattr(loop, name, getattr(self, name))
            else:
                setattr(loop, name, getattr(self, name))

    def live_topology(self) -> Topology:
        return Topology.uniform(2, 2, 4)

    def start_controller(self, job_id: str, run_cfg: Any, **kwargs: Any) -> FakeController:
        if job_id in self.controllers:
            raise ControllerExists(job_id)
        self.starts.append(job_id)
        if self.starts_file is not None:
            with open(self.starts_file, "a") as f:
                f.write(job_id + "\n")
        self.controllers[job_id] = FakeController(job_id)
        return self.controllers[job_id]

    def find_controller(self, job_id: str) -> FakeController | None:
        if self.every_job_has_a_controller:
            self.controllers.setdefault(job_id, FakeController(job_id))
        return self.controllers.get(job_id)

    def kill_controller(self, job_id: str) -> bool:
        return self.controllers.pop(job_id, None) is not None

    def controller_job_ids(self) -> list[str]:
        return sorted(self.controllers)
