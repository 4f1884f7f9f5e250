"""Hot spares: warm rank actors kept beside a job, so that a lost rank is replaced without a cold start.

A `SparePool` keeps `size` `RankActor`s created as rank -1 (up, torch and the engine imported), each
holding one GPU outside the job's placement group. A replacement takes one (`take`), makes it rank r
(`RankActor.assign`), and the pool refills in the background. `fill_targets` (pure) says where spares
go: schedulable nodes with a free GPU not excluded, one per node first, the preferred nodes first (TP > 1:
the job's own, the only place a spare can join a TP group), the avoided ones last (TP = 1: the job's own,
so a node loss does not take the spares too), the preferred rack next. `choose_spare` (pure) says which
one a lost rank gets: never one on an excluded node; with TP peers only one on their node (else None: the
caller starts a fresh actor); warm first, the rank's rack first. Ray is behind a `SpareBackend`
(`RaySpareBackend`); `JobSpares` is what a `RayWorkerGroup` does with its pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.placement import RankPlacement
from workers.topology import NodeInfo, Topology
from workers.warm_workers import started_warm

log = logging.getLogger(__name__)

SPARE_RANK = -1  # the identity a spare is created with until `assign` makes it a rank
READY_TIMEOUT_S = 120.0  # a spare not up by then is dropped (and replaced by the next refill)


def unusable_nodes(health: Mapping[str, str], cordoned: Collection[str] = (),
                   exclude: Collection[str] = ()) -> set[str]:
    """The nodes no spare may be on: quarantined or dead in `health`, cordoned, or excluded."""
    return {n for n, h in health.items() if h in ("quarantined", "dead")} | set(cordoned) | set(exclude)


class SpareBackend(Protocol):
    def nodes(self) -> Sequence[NodeInfo]:
        """The cluster's nodes with their free GPUs now."""

    def create(self, node: NodeInfo) -> Any:
        """Start a spare rank actor on `node` (without waiting for it); its handle."""

    def ready(self, handle: Any, timeout_s: float) -> dict[str, Any] | None:
        """Where the spare runs (`RankActor.where()`) once it is up; None if not up within `timeout_s`.
        Raises if it died."""

    def kill(self, handle: Any) -> None:
        """End the spare's process."""


@dataclass
class Spare:
    handle: Any
    node_id: str  # intended until the spare is up, then where it really runs
    node_name: str
    rack: str
    created: float  # monotonic
    state: str = "starting"  # "starting" | "warm"
    info: dict[str, Any] = field(default_factory=dict)

    def on(self, nodes: Collection[str]) -> bool:
        return self.node_id in nodes or self.node_name in nodes


def fill_targets(
    nodes: Sequence[NodeInfo], count: int, *, have: Sequence[str] = (), exclude: Collection[str] = (),
    prefer_nodes: Collection[str] = (), avoid_nodes: Collection[str] = (), prefer_rack: str | None = None,
) -> list[NodeInfo]:
    """The nodes for `count` new spares (a node may repeat while it has free GPUs); `have`: the node
    names of the spares already kept (spares spread over nodes first)."""
    ex, pref, avoid = set(exclude), set(prefer_nodes), set(avoid_nodes)
    usable = [n for n in nodes if n.schedulable and n.gpus_free > 0 and not {n.node_id, n.name} & ex]
    free = {n.node_id: n.gpus_free for n in usable}
    placed = {n.name: sum(1 for h in have if h == n.name) for n in usable}
    out: list[NodeInfo] = []
    for _ in range(count):
        left = [n for n in usable if free[n.node_id] > 0]
        if not left:
            break

        def key(n: NodeInfo) -> tuple[int, int, int, int, int, str]:
            ids = {n.node_id, n.name}
            return (0 if ids & pref else 1, 1 if ids & avoid else 0, placed[n.name],
                    0 if prefer_rack is None or n.rack == prefer_rack else 1,
                    0 if n.health == "ready" else 1, n.name)

        best = min(left, key=key)
        free[best.node_id] -= 1
        placed[best.name] += 1
        out.append(best)
    return out


def choose_spare(
    spares: Sequence[Spare], *, node: str | None = None, rack: str | None = None,
    tp_node: str | None = None, exclude: Collection[str] = (),
) -> int | None:
    """The index of the spare for a lost rank that ran on `node` in `rack`, or None. `tp_node`: the node
    of the rank's TP peers (a spare elsewhere cannot join the group)."""
    best: tuple[tuple[int, int, int, float], int] | None = None
    for i, s in enumerate(spares):
        if s.on(exclude) or (tp_node is not None and not s.on({tp_node})):
            continue
        same_node = node is not None and s.on({node})
        key = (0 if s.state == "warm" else 1, 0 if rack is not None and s.rack == rack else 1,
               1 if same_node and tp_node is None else 0, s.created)
        if best is None or key < best[0]:
            best = (key, i)
    return None if best is None else best[1]


class SparePool:
    """Keeps `size` warm spare rank actors for one job (thread-safe; `refill` works in the background)."""

    def __init__(
        self, job_id: str, size: int, backend: SpareBackend, *,
        bad_nodes: Callable[[], Collection[str]] = lambda: (), ready_timeout_s: float = READY_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id, self.size, self.backend = job_id, max(0, int(size)), backend
        self._bad_nodes = bad_nodes  # quarantined, dead, cordoned (the controller's view, read each time)
        self.ready_timeout_s, self._clock = ready_timeout_s, clock
        self._lock = threading.RLock()
        self._spares: list[Spare] = []
        self._fill_args: dict[str, Any] = {}  # the last `fill`'s, for `refill`
        self._thread: threading.Thread | None = None
        self._again = self._closed = False

    # ---- keeping the pool full ------------------------------------------------------------------
    def fill(
        self, exclude_nodes: Collection[str] = (), *, prefer_nodes: Collection[str] = (),
        avoid_nodes: Collection[str] = (), prefer_rack: str | None = None,
    ) -> int:
        """Start spares until `size` are kept (not waiting for them to be up); how many it started."""
        self._fill_args = {"exclude_nodes": set(exclude_nodes), "prefer_nodes": set(prefer_nodes),
                           "avoid_nodes": set(avoid_nodes), "prefer_rack": prefer_rack}
        with self._lock:
            if self._closed or len(self._spares) >= self.size:
                return 0
        try:
            nodes = self.backend.nodes()  # outside the lock: `take` never waits on a cluster read
        except Exception as e:  # noqa: BLE001 - no spares this time; the next refill tries again
            log.warning("job %s: cannot read the cluster for spares: %s", self.job_id, e)
            return 0
        with self._lock:
            self._drop_excluded()
            missing = self.size - len(self._spares)
            if self._closed or missing <= 0:
                return 0
            targets = fill_targets(nodes, missing, have=[s.node_name for s in self._spares],
                                   exclude=self._excluded(), prefer_nodes=prefer_nodes,
                                   avoid_nodes=avoid_nodes, prefer_rack=prefer_rack)
            for n in targets:
                try:
                    handle = self.backend.create(n)
                except Exception as e:  # noqa: BLE001 - one spare fewer; said in the log
                    log.warning("job %s: spare on %s not started: %s", self.job_id, n.name, e)
                    continue
                self._spares.append(Spare(handle, n.node_id, n.name, n.rack, self._clock()))
            if len(targets) < missing:
                log.info("job %s: %d of %d spares placed (no more free GPUs on usable nodes)",
                         self.job_id, len(self._spares), self.size)
            return len(targets)

    def refill(self) -> None:
        """`fill` with the last arguments and wait for the new spares to be up, in a background thread
        (returns at once; a call while one runs makes it go round once more)."""
        if self.size == 0:
            return
        with self._lock:
            if self._closed:
                return
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return
            self._again = False
            self._thread = threading.Thread(target=self._refill_loop, name=f"lattice-spares-{self.job_id}",
                                            daemon=True)
            self._thread.start()

    def _refill_loop(self) -> None:
        rounds = 0
        while True:
            rounds += 1
            dropped = 0
            try:
                self.fill(**self._fill_args)
                dropped = self.wait_ready()
            except Exception:  # a background thread must not die silently
                log.exception("job %s: spare refill failed", self.job_id)
            with self._lock:
                if dropped and rounds < 3 and not self._closed:  # replace the ones that landed badly
                    continue
                if not self._again or self._closed:
                    self._thread = None
                    return
                self._again = False

    def wait_ready(self, timeout_s: float | None = None) -> int:
        """Wait for the starting spares to be up: warm ones get their real node, a dead one, one not up
        in time or one that landed on an excluded node is dropped; how many were dropped."""
        with self._lock:
            starting = [s for s in self._spares if s.state == "starting"]
        limit = self.ready_timeout_s if timeout_s is None else timeout_s
        dropped = 0
        for s in starting:
            left = max(0.0, limit - (self._clock() - s.created))
            try:
                info = self.backend.ready(s.handle, left)
            except Exception as e:  # noqa: BLE001 - a spare that died is dropped
                log.info("job %s: spare on %s died before it was up: %s", self.job_id, s.node_name, e)
                self._drop(s, kill=False)
                dropped += 1
                continue
            if info is None:
                if self._clock() - s.created >= self.ready_timeout_s:
                    log.warning("job %s: spare on %s not up after %.0fs; dropped", self.job_id, s.node_name,
                                self.ready_timeout_s)
                    self._drop(s)
                    dropped += 1
                continue
            with self._lock:
                s.node_id, s.node_name = str(info["node_id"]), str(info["node_name"])
                s.rack, s.info, s.state = str(info["rack"]), dict(info), "warm"
        with self._lock:
            return dropped + self._drop_excluded()

    # ---- using a spare --------------------------------------------------------------------------
    def take(
        self, *, node: str | None = None, rack: str | None = None, tp_node: str | None = None,
        exclude_nodes: Collection[str] = (),
    ) -> Any | None:
        """A spare for a rank lost on `node` in `rack` (removed from the pool), or None: see
        `choose_spare`. The caller assigns it and calls `refill`."""
        with self._lock:
            if self._closed:
                return None
            self._drop_excluded(exclude_nodes)
            i = choose_spare(self._spares, node=node, rack=rack, tp_node=tp_node,
                             exclude=self._excluded(exclude_nodes))
            if i is None:
                return None
            spare = self._spares.pop(i)
        log.info("job %s: spare on %s (%s) taken", self.job_id, spare.node_name, spare.state)
        return spare.handle

    def prune(self, exclude_nodes: Collection[str] = ()) -> int:
        """Drop the spares on nodes that became unusable; how many were dropped."""
        with self._lock:
            return self._drop_excluded(exclude_nodes)

    # ---- what is there --------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return [{"job": self.job_id, "node": s.node_name, "rack": s.rack, "state": s.state,
                     "age_s": round(now - s.created, 3), "pid": s.info.get("pid")} for s in self._spares]

    def __len__(self) -> int:
        with self._lock:
            return len(self._spares)

    def shutdown(self) -> None:
        """Kill every spare; the pool stays closed."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for s in spares:
            self._kill(s)

    # ---- internals ------------------------------------------------------------------------------
    def _excluded(self, extra: Collection[str] = ()) -> set[str]:
        try:
            bad = set(self._bad_nodes())
        except Exception as e:  # noqa: BLE001 - the caller's view failed: use what it was given
            log.debug("job %s: bad-node view failed: %s", self.job_id, e)
            bad = set()
        return bad | set(self._fill_args.get("exclude_nodes", ())) | set(extra)

    def _drop_excluded(self, extra: Collection[str] = ()) -> int:
        ex = self._excluded(extra)
        doomed = [s for s in self._spares if s.on(ex)]
        for s in doomed:
            log.info("job %s: spare on %s dropped (node excluded)", self.job_id, s.node_name)
            self._drop(s)
        return len(doomed)

    def _drop(self, spare: Spare, *, kill: bool = True) -> None:
        with self._lock:
            if spare in self._spares:
                self._spares.remove(spare)
        if kill:
            self._kill(spare)

    def _kill(self, spare: Spare) -> None:
        try:
            self.backend.kill(spare.handle)
        except Exception as e:  # noqa: BLE001 - already dead
            log.debug("job %s: kill spare: %s", self.job_id, e)


class RaySpareBackend:
    """Spares as `RankActor`s (the worker group's remote class) pinned to a node, outside any placement
    group. The node affinity is soft (a node that went away does not leave the actor pending forever);
    where a spare really landed is read back and a spare on an excluded node is dropped."""

    def __init__(self, actor_class: Any, job_id: str, *, cpus: float = 0.1,
                 runtime_env: Mapping[str, Any] | None = None) -> None:
        self.actor_class = actor_class
        self.job_id = job_id
        self.cpus = cpus
        self.runtime_env = dict(runtime_env or {})  # the job's ranks' (workers.warm_workers.rank_runtime_env)

    def nodes(self) -> Sequence[NodeInfo]:
        return Topology.from_ray(include_dead=False).gpu_nodes

    def create(self, node: NodeInfo) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return self.actor_class.options(
            num_gpus=1, num_cpus=self.cpus, max_concurrency=4, runtime_env=self.runtime_env,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=True),
        ).remote(self.job_id, SPARE_RANK, 0, {})

    def ready(self, handle: Any, timeout_s: float) -> dict[str, Any] | None:
        import ray

        ref = handle.ready.remote()  # up and its engine imported
        done, _ = ray.wait([ref], timeout=timeout_s)
        return dict(ray.get(done[0])) if done else None

    def kill(self, handle: Any) -> None:
        import ray

        ray.kill(handle, no_restart=True)


class JobSpares:
    """A worker group's use of its pool (none when `size` is 0): fill once the ranks run (a TP > 1 job
    prefers its own nodes, the only place a spare can join a TP group; a TP = 1 job keeps spares off
    them), a spare for a lost rank (`fresh`), and how the last replacements were got."""

    def __init__(self, job_id: str, size: int, actor_class: Any, *, cpus: float,
                 runtime_env: Mapping[str, Any], exclude: Callable[[], Collection[str]] | None,
                 timeout_s: float) -> None:
        self.job_id, self.size, self.timeout_s = job_id, max(0, int(size)), timeout_s
        self.exclude = exclude or (lambda: ())
        self.backend = RaySpareBackend(actor_class, job_id, cpus=cpus, runtime_env=runtime_env)
        self.pool: SparePool | None = None
        self.replaced: dict[int, dict[str, Any]] = {}  # rank -> how its replacement was got

    def fill(self, where: Sequence[RankPlacement]) -> None:
        if self.size == 0:
            return
        if self.pool is None:
            self.pool = SparePool(self.job_id, self.size, self.backend, bad_nodes=self.exclude,
                                  ready_timeout_s=self.timeout_s)
        nodes, racks = {p.node_name for p in where}, [p.rack for p in where]
        groups = [(p.pp, p.dp, p.cp) for p in where]
        tp = len(groups) > len(set(groups))
        self.pool.fill(prefer_nodes=nodes if tp else (), avoid_nodes=() if tp else nodes,
                       prefer_rack=max(set(racks), key=racks.count) if racks else None)
        self.pool.refill()  # waits for them to be up, in the background

    def fresh(self, r: RankPlacement, world: int, where: Sequence[RankPlacement],
              new: Callable[[], Any]) -> Any:
        """An actor for the lost rank `r`: a spare made rank r when one fits, else `new()`."""
        t0 = time.time()
        actor = self._take(r, world, where)
        self.replaced[r.rank] = {"spare": actor is not None, "t0": t0, "warm": time.time(), "actor": actor}
        if actor is None:
            actor = self.replaced[r.rank]["actor"] = new()
        return actor

    def _take(self, r: RankPlacement, world: int, where: Sequence[RankPlacement]) -> Any | None:
        import ray

        pool = self.pool
        if pool is None:
            return None
        lost = next((p for p in where if p.rank == r.rank), r)
        peers = [p for p in where if (p.pp, p.dp, p.cp) == (r.pp, r.dp, r.cp) and p.rank != r.rank]
        handle = pool.take(node=lost.node_name, rack=lost.rack, exclude_nodes=self.exclude(),
                           tp_node=peers[0].node_name if peers else None)
        pool.refill()
        if handle is None:
            return None
        try:
            ray.get(handle.assign.remote(r.rank, world, {"pp": r.pp, "dp": r.dp, "cp": r.cp, "tp": r.tp}),
                    timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a spare that died or hangs: a fresh actor instead
            log.warning("job %s: spare for rank %d unusable (%s): a fresh actor", self.job_id, r.rank, e)
            self.backend.kill(handle)
            return None
        log.info("job %s: rank %d replaced by a warm spare", self.job_id, r.rank)
        return handle

    def for_referee(self, exclude: Collection[str]) -> Any | None:
        """A warm spare outside `exclude` (the suspects' nodes) for the SDC referee, or None."""
        if self.pool is None:
            return None
        handle = self.pool.take(exclude_nodes={*self.exclude(), *exclude})
        self.pool.refill()
        return handle

    def describe(self) -> list[dict[str, Any]]:
        pool = self.pool  # read once: the controller's poll thread calls this while its loop runs
        if pool is None:
            return []
        if pool.prune(self.exclude()):
            pool.refill()
        return pool.describe()

    def replacement_info(self, timeout_s: float) -> dict[str, Any]:
        """`spare_used` (any replaced rank), `replacement_s` (request to a warm actor, the slowest) and
        `warm_process` (the others all started in warm processes: workers.warm_workers)."""
        import ray

        replaced, self.replaced = self.replaced, {}
        seconds, prestarted = [], []
        for r, got in replaced.items():
            if not got["spare"] and (w := started_warm(got["actor"], got["t0"], timeout_s)) is not None:
                prestarted.append(w)
            warm = got["warm"]  # a warm spare's: when it was taken; a fresh actor's, or a spare
            try:  # taken while still importing: when its imports were done
                warm = max(warm, float(ray.get(got["actor"].warm_since.remote(), timeout=timeout_s)))
            except Exception as e:  # noqa: BLE001 - a rank that died since has no warm-up time
                log.debug("rank %d: no warm-up time: %s", r, e)
                if not got["spare"]:
                    continue
            seconds.append(max(0.0, warm - got["t0"]))
        if not replaced:
            return {}
        return {"spare_used": any(g["spare"] for g in replaced.values()),
                "replacement_s": round(max(seconds), 3) if seconds else None,
                "warm_process": all(prestarted) if prestarted else None}

    def shutdown(self) -> None:
        """Kill the spares (the next `fill` starts a new pool)."""
        self.replaced = {}
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


__all__ = ["SPARE_RANK", "JobSpares", "RaySpareBackend", "Spare", "SpareBackend", "SparePool",
           "choose_spare", "fill_targets", "unusable_nodes"]
