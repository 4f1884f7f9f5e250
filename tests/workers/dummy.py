"""A WorkerGroup without Ray, scripted by the test, and a clock the test moves."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from training.config.run import RunConfig
from workers.placement import Placement, PlacementError, RankPlacement
from workers.topology import Topology
from workers.worker_group import GroupStatus, RankStatus, WorkerGroup, WorkerGroupStartupError


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class DummyWorkerGroup(WorkerGroup):
    def __init__(self, topology: Topology) -> None:
        self.topo = topology
        self.calls: list[str] = []
        self.reserve_error: str | None = None
        self.start_error: str | None = None
        self.poll_error: Exception | None = None
        self.statuses: list[GroupStatus] = []
        self.reserved: Placement | None = None
        self.starts: list[dict[str, Any]] = []
        self.seen_health: dict[str, str] = {}
        self.seen_cordoned: set[str] = set()
        self.landed: list[RankPlacement] | None = None  # where start() says ranks really are
        self.actions: list[str] = []  # request_action calls, in order

    def request_action(self, action: str) -> None:
        self.actions.append(action)

    # ---- WorkerGroup ---------------------------------------------------------------------------
    def topology(self, health: Mapping[str, str], cordoned: Collection[str]) -> Topology:
        self.calls.append("topology")
        self.seen_health, self.seen_cordoned = dict(health), set(cordoned)
        return self.topo.with_health(health, cordoned)

    def reserve(self, placement: Placement) -> None:
        self.calls.append("reserve")
        if self.reserve_error:
            raise PlacementError(self.reserve_error)
        self.reserved = placement

    def start(
        self, run_cfg: RunConfig, *, resume: bool, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
    ) -> list[RankPlacement]:
        self.calls.append("start")
        if self.start_error:
            raise WorkerGroupStartupError(self.start_error)
        assert self.reserved is not None
        self.starts.append({"run_cfg": run_cfg, "resume": resume, "faults": [dict(f) for f in faults],
                            "restore_steps": None if restore_steps is None else sorted(restore_steps),
                            "rerun_spikes": {s: dict(n) for s, n in (rerun_spikes or {}).items()}})
        return list(self.landed or self.reserved.ranks)

    def poll(self) -> GroupStatus:
        self.calls.append("poll")
        if self.poll_error:
            raise self.poll_error
        if self.statuses:
            return self.statuses.pop(0)
        return running(self.world)

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    # ---- scripting helpers ---------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.reserved.world_size if self.reserved else 0

    def push(self, *statuses: GroupStatus) -> None:
        self.statuses.extend(statuses)


def running(
    world: int, events: dict[int, list[dict]] | None = None, **overrides: dict[int, Any]
) -> GroupStatus:
    """All ranks running (and progressing) unless `overrides` says otherwise, e.g.
    running(4, state={2: "dead"}, since_progress_s={1: 90.0})."""
    ranks = {}
    for r in range(world):
        fields: dict[str, Any] = {"rank": r, "state": "running", "stepped": True, "step": 1,
                                  "since_progress_s": 0.1, "events": list((events or {}).get(r, []))}
        for name, per_rank in overrides.items():
            if r in per_rank:
                fields[name] = per_rank[r]
        ranks[r] = RankStatus(**fields)
    return GroupStatus(ranks)


def step_events(world: int, step: int, loss: float, **extra: Any) -> dict[int, list[dict]]:
    return {r: [{"kind": "step", "rank": r, "step": step, "loss": loss, "tokens_per_s": 100.0,
                 "mfu": None, "step_time_s": 0.1, **extra}] for r in range(world)}


def finished(world: int, digest: str = "abc123", final_step: int = 4) -> GroupStatus:
    result = {"final_step": final_step, "losses": [4.0, 3.5, 3.0, 2.5], "model_digest": digest,
              "checkpoints": [{"step": final_step, "path": "/ckpt/step-4"}], "resumed_from": None}
    return GroupStatus({r: RankStatus(rank=r, state="finished", stepped=True, step=final_step, result=result)
                        for r in range(world)})
