"""The ranks of one job as a group: the interface the controller drives, and its Ray version.

`WorkerGroup` is what the controller's state machine talks to (after Ray Train v2): read the
topology, gang-reserve a placement, start the ranks, poll them, shut them down. Tests drive the
state machine against a dummy implementation one transition at a time; `RayWorkerGroup` is the
real one: one placement group per job, one `RankActor` per bundle.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from training.config.run import RunConfig
from workers.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LogTarget, job_logs_dir, new_attempt
from workers.names import placement_group_name
from workers.placement import Placement, PlacementError, RankPlacement, release, reserve
from workers.rank import DEFAULT_TRAIN_FN, RankActor
from workers.topology import Topology

log = logging.getLogger(__name__)

# idle/running/finished/failed come from the actor; dead/unresponsive from the group's view of it.
RANK_STATES = ("idle", "running", "finished", "failed", "dead", "unresponsive")


class WorkerGroupError(RuntimeError):
    pass


class WorkerGroupStartupError(WorkerGroupError):
    """Rank actors could not be created, did not report in, or the rendezvous failed."""


@dataclass
class RankStatus:
    rank: int
    state: str
    events: list[dict[str, Any]] = field(default_factory=list)
    since_progress_s: float = 0.0  # seconds since the rank's training thread last made progress
    stepped: bool = False  # has completed at least one step in this attempt
    step: int | None = None
    result: dict[str, Any] | None = None
    error: str | None = None
    dropped: int = 0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankStatus:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class GroupStatus:
    ranks: dict[int, RankStatus]

    def in_state(self, *states: str) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.state in states)

    @property
    def all_finished(self) -> bool:
        return bool(self.ranks) and all(s.state == "finished" for s in self.ranks.values())


class WorkerGroup(ABC):
    """What the controller needs from 'the ranks of this job'."""

    @abstractmethod
    def topology(self, health: Mapping[str, str], cordoned: Collection[str]) -> Topology:
        """The cluster now, with the given health ledger merged in."""

    @abstractmethod
    def reserve(self, placement: Placement) -> None:
        """Gang-reserve every rank's GPU; raises PlacementError (ReservationTimeout) if not granted."""

    @abstractmethod
    def start(
        self, run_cfg: RunConfig, *, resume: bool, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
    ) -> list[RankPlacement]:
        """Create the ranks in the reservation, rendezvous, launch training. Returns where each
        rank really runs. `faults` ({"kind", "rank", "at_step", ...}) are armed before training
        starts (fault injection); `restore_steps` limits the checkpoints the ranks may resume
        from (the verified ones; None = any valid one). Raises WorkerGroupStartupError."""

    @abstractmethod
    def poll(self) -> GroupStatus:
        """Events since the last poll and a heartbeat from every rank."""

    @abstractmethod
    def shutdown(self) -> None:
        """End the ranks and release the reservation; idempotent."""

    def inject_fault(self, kind: str, rank: int, at_step: int, **params: Any) -> None:
        """Schedule a rank-level fault (fault injection). Optional for implementations."""
        raise NotImplementedError(f"{type(self).__name__} does not inject faults")

    def replace_ranks(
        self, ranks: Sequence[int], run_cfg: RunConfig, *, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
    ) -> list[RankPlacement]:
        """The recovery fast path: keep the other ranks' processes, start new ones for `ranks` in their
        reservation slots, rendezvous again on a new port and resume everyone. Raises
        WorkerGroupError when it cannot (the caller falls back to a full restart)."""
        raise WorkerGroupError(f"{type(self).__name__} cannot replace single ranks")

    def kill_ranks_on_node(self, node_name: str) -> list[int]:
        """End every rank process on `node_name` (a node death without a cluster to remove it from)."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill ranks")

    def node_alive(self, node_name: str) -> bool:
        """Does the cluster still see this node alive (default: assume so)?"""
        return True

    def request_action(self, action: str) -> None:  # noqa: B027 - an optional hook that may do nothing
        """Ask every rank for 'checkpoint' / 'stop' / 'checkpoint_and_stop' at the next step."""

    def dump_collectives(self) -> None:  # noqa: B027 - an optional hook that may do nothing
        """Ask every live rank to write its flight recorder into the job's folder
        (workers.collective_trace)."""


RemoteRankActor = ray.remote(RankActor)


class RayWorkerGroup(WorkerGroup):
    def __init__(
        self,
        job_id: str,
        *,
        cpus_per_rank: float = 0.1,
        reserve_timeout_s: float = 30.0,
        start_timeout_s: float = 120.0,
        poll_timeout_s: float = 10.0,
        rendezvous_timeout_s: float = 120.0,
        collective_timeout_s: float | None = None,
        train_fn: str = DEFAULT_TRAIN_FN,
        flops_per_token: float | None = None,
        env_vars: Mapping[str, str] | None = None,
        should_stop: Callable[[], bool] | None = None,
        log_max_bytes: int = DEFAULT_MAX_BYTES,
        log_backups: int = DEFAULT_BACKUPS,
    ) -> None:
        self.job_id = job_id
        self.log_max_bytes, self.log_backups = log_max_bytes, log_backups
        self.cpus_per_rank = cpus_per_rank
        self.reserve_timeout_s = reserve_timeout_s
        self.start_timeout_s = start_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.train_fn = train_fn
        self.flops_per_token = flops_per_token
        self.env_vars = {"OMP_NUM_THREADS": "1", **(env_vars or {})}
        self._should_stop = should_stop or (lambda: False)
        self._pg: Any = None
        self._placement: Placement | None = None
        self._actors: list[Any] = []
        self._where: list[RankPlacement] = []
        self._attempt = 0

    # ---- topology / reservation ------------------------------------------------------------------
    def topology(self, health: Mapping[str, str], cordoned: Collection[str]) -> Topology:
        return Topology.from_ray(health, cordoned)

    def reserve(self, placement: Placement) -> None:
        if self._pg is not None:
            self.shutdown()
        self._attempt += 1
        self._pg = reserve(
            placement,
            name=placement_group_name(self.job_id, self._attempt),
            cpus_per_rank=self.cpus_per_rank,
            timeout_s=self.reserve_timeout_s,
            should_stop=self._should_stop,
        )
        self._placement = placement

    # ---- ranks -------------------------------------------------------------------------------------
    def spawn(self) -> list[RankPlacement]:
        """Create one rank actor per bundle and read back where each one landed."""
        if self._pg is None or self._placement is None:
            raise WorkerGroupStartupError("start() before reserve(): no placement group")
        placement = self._placement
        world = placement.world_size
        try:
            self._actors = [self._new_actor(r, world) for r in placement.ranks]
            where = ray.get([a.where.remote() for a in self._actors], timeout=self.start_timeout_s)
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            raise WorkerGroupStartupError(f"rank actors did not start: {e}") from e
        actual = []
        for intended, w in zip(placement.ranks, where, strict=True):
            actual.append(
                RankPlacement(
                    rank=intended.rank, pp=intended.pp, dp=intended.dp, cp=intended.cp, tp=intended.tp,
                    node_id=w["node_id"], node_name=w["node_name"], rack=w["rack"], gpu=w["gpu"],
                )
            )
            if w["node_id"] != intended.node_id:
                log.warning("rank %d landed on %s, not %s", intended.rank, w["node_name"], intended.node_name)
        return actual

    def _new_actor(self, r: RankPlacement, world: int) -> Any:
        return RemoteRankActor.options(
            num_gpus=1,
            num_cpus=self.cpus_per_rank,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=r.rank
            ),
            runtime_env={"env_vars": dict(self.env_vars)},
        ).remote(self.job_id, r.rank, world, {"pp": r.pp, "dp": r.dp, "cp": r.cp, "tp": r.tp})

    def launch(
        self, run_cfg: RunConfig, *, resume: bool, restore_steps: Collection[int] | None = None
    ) -> None:
        """Rendezvous on rank 0's address (a fresh port each time) and start training on every rank."""
        if not self._actors:
            raise WorkerGroupStartupError("launch() before spawn()")
        steps = None if restore_steps is None else sorted(restore_steps)
        logs = self._log_target(run_cfg)
        try:
            addr, port = ray.get(self._actors[0].rendezvous.remote(), timeout=self.start_timeout_s)
            ray.get(
                [
                    a.start.remote(
                        addr, port, run_cfg, resume=resume, train_fn=self.train_fn,
                        flops_per_token=self.flops_per_token, rendezvous_timeout_s=self.rendezvous_timeout_s,
                        collective_timeout_s=self.collective_timeout_s, restore_steps=steps, log_target=logs,
                    )
                    for a in self._actors
                ],
                timeout=self.start_timeout_s,
            )
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            raise WorkerGroupStartupError(f"rendezvous/launch failed: {e}") from e

    def _log_target(self, run_cfg: RunConfig) -> LogTarget | None:
        """A new attempt folder in the job's logs (workers.logs), or None without a job folder."""
        if not run_cfg.checkpoint.dir:
            return None
        logs_dir = job_logs_dir(run_cfg.checkpoint.dir)
        try:
            attempt = new_attempt(logs_dir)
        except OSError as e:  # the ranks train without their logs rather than not at all
            log.warning("job %s: cannot create its log folder under %s: %s", self.job_id, logs_dir, e)
            return None
        return LogTarget(str(logs_dir), attempt, self.log_max_bytes, self.log_backups)

    def _arm(self, faults: Sequence[Mapping[str, Any]], ranks: Collection[int] | None = None) -> None:
        for f in faults:
            rank = int(f.get("rank") or 0)  # controller-side faults are triggered by rank 0 by default
            if ranks is not None and rank not in ranks:
                continue
            params = {k: v for k, v in f.items() if k not in ("kind", "rank", "at_step")}
            self.inject_fault(str(f["kind"]), rank, int(f["at_step"]), **params)

    def start(
        self, run_cfg: RunConfig, *, resume: bool, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
    ) -> list[RankPlacement]:
        actual = self.spawn()
        self._arm(faults)
        self.launch(run_cfg, resume=resume, restore_steps=restore_steps)
        self._where = actual
        return actual

    def replace_ranks(
        self, ranks: Sequence[int], run_cfg: RunConfig, *, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None,
    ) -> list[RankPlacement]:
        if self._pg is None or self._placement is None or not self._actors:
            raise WorkerGroupError("no running group to repair")
        placement, world = self._placement, self._placement.world_size
        doomed = set(ranks)
        for r in doomed:  # a hung rank is still alive: end it, which also frees its peers' collectives
            try:
                ray.kill(self._actors[r], no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill rank %d: %s", r, e)
        survivors = [r for r in range(world) if r not in doomed]
        try:
            for r in doomed:
                self._actors[r] = self._new_actor(placement.ranks[r], world)
            timeout = self.start_timeout_s
            resets = [self._actors[r].reset.remote() for r in survivors]  # while the new ones start
            where = ray.get([self._actors[r].where.remote() for r in sorted(doomed)], timeout=timeout)
            done = ray.get(resets, timeout=timeout)
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            raise WorkerGroupError(f"fast path: replacement ranks did not start: {e}") from e
        stuck = [r for r, ok in zip(survivors, done, strict=True) if not ok]
        if stuck:
            raise WorkerGroupError(f"fast path: ranks {stuck} are still inside the failed step")
        actual = {r.rank: r for r in self._where}
        for r, w in zip(sorted(doomed), where, strict=True):
            i = placement.ranks[r]
            actual[r] = RankPlacement(rank=r, pp=i.pp, dp=i.dp, cp=i.cp, tp=i.tp, node_id=w["node_id"],
                                      node_name=w["node_name"], rack=w["rack"], gpu=w["gpu"])
        self._arm(faults, doomed)
        self.launch(run_cfg, resume=True, restore_steps=restore_steps)
        self._where = [actual[r] for r in sorted(actual)]
        return list(self._where)

    def kill_ranks_on_node(self, node_name: str) -> list[int]:
        killed = [r.rank for r in self._where if r.node_name == node_name]
        for r in killed:
            try:
                ray.kill(self._actors[r], no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill rank %d: %s", r, e)
        return killed

    def node_alive(self, node_name: str) -> bool:
        ids = {r.node_id for r in self._where if r.node_name == node_name}
        for n in ray.nodes():
            labels = n.get("Labels") or {}
            if str(n["NodeID"]) in ids or labels.get("node_name") == node_name:
                if n.get("Alive"):
                    return True
        return False

    def request_action(self, action: str) -> None:
        for a in self._actors:
            try:
                a.request_action.remote(action)
            except Exception as e:  # noqa: BLE001 - a dead rank is the failure path's business
                log.debug("request_action: %s", e)

    def poll(self) -> GroupStatus:
        refs = [a.poll.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.poll_timeout_s)
        ready_set = set(ready)
        out: dict[int, RankStatus] = {}
        for rank, ref in enumerate(refs):
            if ref not in ready_set:
                out[rank] = RankStatus(rank=rank, state="unresponsive", error="poll timed out")
                continue
            try:
                out[rank] = RankStatus.from_dict(ray.get(ref))
            except ActorUnavailableError as e:
                out[rank] = RankStatus(rank=rank, state="unresponsive", error=str(e)[:500])
            except (ActorDiedError, RayActorError) as e:
                out[rank] = RankStatus(rank=rank, state="dead", error=str(e)[:500])
        return GroupStatus(out)

    def dump_collectives(self) -> None:
        refs = [a.dump_collectives.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.poll_timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a dead or stuck rank has no dump; the others do
                log.debug("dump_collectives: %s", e)

    def actors(self) -> list[Any]:
        return list(self._actors)

    def inject_fault(self, kind: str, rank: int, at_step: int, **params: Any) -> None:
        if not 0 <= rank < len(self._actors):
            raise ValueError(f"fault rank must be in [0, {len(self._actors)}), got {rank}")
        try:
            ref = self._actors[rank].schedule_fault.remote(kind, at_step, **params)
            # Arming is part of a rank's start-up (a bit flip imports torch in a fresh actor): the
            # start-up timeout applies, not the poll timeout (a loaded node took over 10 s).
            ray.get(ref, timeout=self.start_timeout_s)
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            raise WorkerGroupError(f"could not arm {kind} on rank {rank}: {e}") from e

    def shutdown(self) -> None:
        for a in self._actors:
            try:
                a.stop.remote()
                ray.kill(a, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill rank actor: %s", e)
        self._actors = []
        self._where = []
        release(self._pg)
        self._pg = None
        self._placement = None


__all__ = [
    "GroupStatus", "PlacementError", "RankStatus", "RayWorkerGroup", "WorkerGroup",
    "WorkerGroupError", "WorkerGroupStartupError",
]
