"""The ranks of one job as a group on Ray: `RayWorkerGroup`, the real `WorkerGroup`
(workers.group_interface: what the controller's state machine talks to, after Ray Train v2). One
placement group per job, one `RankActor` per bundle; a replaced rank may take a hot spare
(workers.spares) or move off an unusable node (workers.relocate), and the survivors may hand it
their state (workers.recovery_path).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from training.config.run import RunConfig
from workers import recovery_path
from workers.group_interface import (
    GroupStatus,
    RankStatus,
    WorkerGroup,
    WorkerGroupError,
    WorkerGroupStartupError,
)
from workers.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, LogTarget, job_logs_dir, new_attempt
from workers.names import placement_group_name
from workers.placement import NODE_ID_LABEL, Placement, PlacementError, RankPlacement, release, reserve
from workers.rank import DEFAULT_TRAIN_FN, RankActor
from workers.recovery_path import RecoveryPath
from workers.relocate import relocate, standby_nodes
from workers.spares import JobSpares
from workers.topology import Topology
from workers.warm_workers import WarmWorkers, rank_runtime_env

log = logging.getLogger(__name__)
# How long a surviving rank may take to leave the failed step before the fast path gives up on it
# (its thread ends once its collective with a lost rank breaks: under a second here; the rest is margin
# for a loaded host).
SURVIVOR_UNWIND_S = 30.0
STANDBY_REFRESH_S = 15.0  # how often the nodes a lost node's ranks would move to are recomputed (2 GCS reads)

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
        spares: int = 0,
        spare_exclude: Callable[[], Collection[str]] | None = None,
        warm_workers: int = 1,
        warm_standby: bool = True,
    ) -> None:
        """`spares`: warm spare rank actors kept while the ranks run (workers.spares); `spare_exclude`:
        the nodes no spare may be on or come from now (quarantined, dead, cordoned); `warm_workers`:
        idle processes with the engine imported kept on each of the job's nodes, for a replacement rank
        to start in (workers.warm_workers), and with `warm_standby` on its standby nodes too."""
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
        self.runtime_env = rank_runtime_env(self.env_vars)
        self._warm, self._warm_standby = WarmWorkers(self.runtime_env, warm_workers), warm_standby
        self._exclude = spare_exclude or (lambda: ())
        self._standby: dict[str, int] = {}  # node id -> warm processes for ranks that would move there
        self._standby_at = float("-inf")
        self._spares = JobSpares(job_id, spares, RemoteRankActor, cpus=cpus_per_rank,
                                 runtime_env=self.runtime_env, exclude=spare_exclude,
                                 timeout_s=start_timeout_s)
        self._should_stop = should_stop or (lambda: False)
        self._pg: Any = None
        self._placement: Placement | None = None
        self._actors: list[Any] = []
        self._where: list[RankPlacement] = []
        self._attempt = 0
        # Ranks moved off an unusable node (workers.relocate): their new reservation, one bundle each.
        self._slots: dict[int, Any] = {}
        self._moving: dict[int, Any] = {}  # rank -> the NodeInfo it moves to (reserved on first use)

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
        # Asked for once the ranks hold their processes (else a rank may take the warm one, leaving an
        # idle process Ray reaps), on every spawn (its ranks may have taken the last ones): warm while
        # the ranks rendezvous and build the model (workers.warm_workers).
        nodes = {w["node_id"] for w in where}
        self._warm.taken(nodes)
        self._warm.keep(nodes)
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
        pg, index = self._slot(r.rank)
        return RemoteRankActor.options(
            num_gpus=1,
            num_cpus=self.cpus_per_rank,
            max_concurrency=4,
            runtime_env=self.runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            ),
        ).remote(self.job_id, r.rank, world, {"pp": r.pp, "dp": r.dp, "cp": r.cp, "tp": r.tp})

    def _slot(self, rank: int) -> tuple[Any, int]:
        """Where rank `rank`'s actor goes: its bundle in the job's placement group, or, once moved off
        an unusable node, a one-bundle group pinned to its new node (reserved here on first use)."""
        node = self._moving.pop(rank, None)
        if node is not None:
            from ray.util.placement_group import placement_group, remove_placement_group

            self._attempt += 1
            bundle = {"GPU": 1.0, **({"CPU": float(self.cpus_per_rank)} if self.cpus_per_rank > 0 else {})}
            name = placement_group_name(self.job_id, self._attempt)
            pg = placement_group([bundle], strategy="PACK", name=name,
                                 bundle_label_selector=[{NODE_ID_LABEL: node.node_id}])
            if not pg.wait(timeout_seconds=self.reserve_timeout_s):
                remove_placement_group(pg)
                raise WorkerGroupError(f"rank {rank}: no GPU granted on {node.name} within "
                                       f"{self.reserve_timeout_s:.0f}s to move it to")
            old = self._slots.get(rank)
            if old is not None:
                release(old)
            self._slots[rank] = pg
        pg = self._slots.get(rank)
        return (pg, 0) if pg is not None else (self._pg, rank)

    def _fresh_actor(self, r: RankPlacement, world: int) -> Any:
        """An actor for rank `r` that replaces a lost one: a warm spare that fits (workers.spares), else
        a new actor in r's bundle."""
        return self._spares.fresh(r, world, self._where, lambda: self._new_actor(r, world))

    def describe_spares(self) -> list[dict[str, Any]]:
        return self._spares.describe()

    def describe_warm(self) -> dict[str, int]:
        return self._warm.describe()

    def referee_spare(self, exclude: Collection[str]) -> Any | None:
        """A warm spare outside `exclude` for the SDC referee (workers.referee), or None."""
        return self._spares.for_referee(exclude)

    def replacement_info(self) -> dict[str, Any]:
        return self._spares.replacement_info(self.poll_timeout_s)

    def launch(
        self, run_cfg: RunConfig, *, resume: bool, restore_steps: Collection[int] | None = None,
        peer: RecoveryPath | None = None, rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
    ) -> None:
        """Rendezvous on rank 0's address (a fresh port each time) and start training on every rank
        (from the DP peers' memory when `peer` is a peer path, else from a checkpoint)."""
        if not self._actors:
            raise WorkerGroupStartupError("launch() before spawn()")
        steps = None if restore_steps is None else sorted(restore_steps)
        plan = ({"step": peer.step, "sources": dict(peer.sources)}
                if peer is not None and peer.path == "peer" else None)
        logs = self._log_target(run_cfg)
        try:
            addr, port = ray.get(self._actors[0].rendezvous.remote(), timeout=self.start_timeout_s)
            ray.get(
                [
                    a.start.remote(
                        addr, port, run_cfg, resume=resume, train_fn=self.train_fn,
                        flops_per_token=self.flops_per_token, rendezvous_timeout_s=self.rendezvous_timeout_s,
                        collective_timeout_s=self.collective_timeout_s, restore_steps=steps, log_target=logs,
                        peer=plan, rerun_spikes=rerun_spikes,
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
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
    ) -> list[RankPlacement]:
        actual = self.spawn()
        self._arm(faults)
        self.launch(run_cfg, resume=resume, restore_steps=restore_steps, rerun_spikes=rerun_spikes)
        self._where = actual
        self._spares.fill(actual)
        self._keep_warm(refresh=True)
        return actual

    def replace_ranks(
        self, ranks: Sequence[int], run_cfg: RunConfig, *, faults: Sequence[Mapping[str, Any]] = (),
        restore_steps: Collection[int] | None = None, allow_peer: bool = True,
        rerun_spikes: Mapping[int, Mapping[int, float]] | None = None,
        avoid_nodes: Collection[str] = (), prefer_avoid: Collection[str] = (),
    ) -> list[RankPlacement]:
        """Replace the lost `ranks`, keeping the others' processes; everyone resumes from the DP
        peers' memory when they can (`last_recovery` says which path and why), else the checkpoint.
        Lost ranks on `avoid_nodes` (dead, quarantined, cordoned) move to other nodes, TP groups whole;
        so do those on `prefer_avoid` nodes (suspects) when there is room elsewhere."""
        if self._pg is None or self._placement is None or not self._actors:
            raise WorkerGroupError("no running group to repair")
        placement, world = self._placement, self._placement.world_size
        doomed = set(ranks)
        if avoid_nodes or prefer_avoid:  # ranks on unusable nodes move, TP groups whole (workers.relocate)
            topology = Topology.from_ray(include_dead=False)
            try:
                try:
                    moves = relocate(doomed, self._where, {*avoid_nodes, *prefer_avoid}, topology)
                except PlacementError:  # the preferred ones are usable after all
                    moves = relocate(doomed, self._where, avoid_nodes, topology)
            except PlacementError as e:
                raise WorkerGroupError(f"fast path: {e}") from e
            doomed |= moves.partners
            self._moving = dict(moves.moves)
        for r in doomed:  # a hung rank is still alive: end it, which also frees its peers' collectives
            try:
                ray.kill(self._actors[r], no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill rank %d: %s", r, e)
        survivors = [r for r in range(world) if r not in doomed]
        try:
            for r in sorted(doomed):
                self._actors[r] = self._fresh_actor(placement.ranks[r], world)
            timeout = self.start_timeout_s
            # While the new ones start; a survivor still inside the failed step after SURVIVOR_UNWIND_S
            # is stuck, and the whole group restarts.
            resets = [self._actors[r].reset.remote(SURVIVOR_UNWIND_S) for r in survivors]
            where = ray.get([self._actors[r].where.remote() for r in sorted(doomed)], timeout=timeout)
            done = ray.get(resets, timeout=timeout + SURVIVOR_UNWIND_S)
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            raise WorkerGroupError(f"fast path: replacement ranks did not start: {e}") from e
        finally:
            self._moving = {}  # taken by a spare, or not reached: nothing left reserved for it
        stuck = [r for r, ok in zip(survivors, done, strict=True) if not ok]
        if stuck:
            raise WorkerGroupError(f"fast path: ranks {stuck} are still inside the failed step")
        path = dataclasses.replace(self._recovery_path(run_cfg, placement, doomed, survivors, allow_peer),
                                   lost=tuple(sorted(doomed)))
        actual = {r.rank: r for r in self._where}
        for r, w in zip(sorted(doomed), where, strict=True):
            i = placement.ranks[r]
            actual[r] = RankPlacement(rank=r, pp=i.pp, dp=i.dp, cp=i.cp, tp=i.tp, node_id=w["node_id"],
                                      node_name=w["node_name"], rack=w["rack"], gpu=w["gpu"])
        self._warm.taken({w["node_id"] for w in where})
        self._arm(faults, doomed)
        self.last_recovery = path
        self.launch(run_cfg, resume=True, restore_steps=restore_steps, peer=path, rerun_spikes=rerun_spikes)
        self._where = [actual[r] for r in sorted(actual)]
        self._standby_at = float("-inf")  # where ranks would move now: asked once the ranks train again
        return list(self._where)

    def _recovery_path(self, run_cfg: RunConfig, placement: Placement, lost: Collection[int],
                       survivors: Sequence[int], allow_peer: bool) -> RecoveryPath:
        """Peer or checkpoint (workers.recovery_path), from the step each survivor kept."""
        if not allow_peer or run_cfg.peer_recovery_blocker() is not None:
            return recovery_path.choose(run_cfg, placement.ranks, lost, {}, enabled=allow_peer)
        try:
            kept = ray.get([self._actors[r].kept.remote() for r in survivors], timeout=self.poll_timeout_s)
        except (RayActorError, GetTimeoutError, ActorUnavailableError) as e:
            return RecoveryPath("checkpoint", f"could not ask the survivors what they kept: {e}")
        return recovery_path.choose(run_cfg, placement.ranks, lost, dict(zip(survivors, kept, strict=True)))

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
        if out and all(s.stepped for s in out.values()):  # training: start-up no longer needs the cores
            self._keep_warm(refresh=False)
        return GroupStatus(out)

    def _keep_warm(self, refresh: bool) -> None:
        """Warm processes on the job's nodes and standby nodes (`standby_for`, every STANDBY_REFRESH_S)."""
        if (refresh or time.monotonic() - self._standby_at > STANDBY_REFRESH_S) and self._where:
            self._standby, self._standby_at = self.standby_for(self._where), time.monotonic()
        self._warm.keep({p.node_id for p in self._where}, self._standby)

    def standby_for(self, where: Sequence[RankPlacement]) -> dict[str, int]:
        """Node id -> warm processes for the ranks that would move there if a node of `where` were lost,
        for a job on several nodes without hot spares (the peer path: workers.warm_workers); none when
        `warm_standby` is off (the service's default on CPU node types, admission.warm_standby)."""
        several = len({p.node_id for p in where}) > 1
        if not (several and self._warm_standby and self._spares.size == 0 and self._warm.per_node > 0):
            return {}
        try:
            return standby_nodes(list(where), self._exclude(), Topology.from_ray(include_dead=False))
        except Exception as e:  # noqa: BLE001 - best effort: a moved rank then starts cold
            log.warning("no standby nodes for warm processes: %s", e)
            return {}

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
        for pg in self._slots.values():
            release(pg)
        self._slots, self._moving = {}, {}
        self._pg = None
        self._placement = None
        self._spares.shutdown()

    def close(self) -> None:
        self._warm.release()  # ended now, not left idle until the raylet reaps them


__all__ = [
    "GroupStatus", "PlacementError", "RankStatus", "RayWorkerGroup", "WorkerGroup",
    "WorkerGroupError", "WorkerGroupStartupError",
]
