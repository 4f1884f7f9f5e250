"""Warm worker processes: idle Ray workers with torch and the engine already imported, kept on a job's
nodes, so that a replacement rank without a hot spare does not import torch on the recovery path.

Every rank actor of a job (and its spares) is created with `rank_runtime_env(env)`: the job's
environment and Ray's worker setup hook, `workers.engine_imports.preload`, which a worker process
started for that runtime env runs as it starts. `WarmWorkers.keep(nodes)` asks the raylet
of each node for such processes ahead of need (workers.raylets; with a keep-alive, so that the idle
process is not reaped); Ray hands an idle process whose runtime env matches to the next actor created
with it, which then answers in ~0.1 s instead of spending seconds starting a process and importing
torch. Without a warm process (none asked for yet, or the call failed: it is Ray's internal API, so a
failure is logged and never raised) the actor starts cold, as before.

The job's processes are counted, not assumed: it remembers the pids it started on each node and,
every CHECK_S and whenever what it wants changes, asks a node only for the difference between what
it wants there and those of its pids still idle (a replacement took one, the raylet reaped one whose
keep-alive ran out); a node it no longer wants processes on, or fewer, has the rest ended. `release()`
ends them all when the job is over, instead of leaving them idle until the raylet reaps them.
Costs: one idle process per node (a few hundred MB of host memory) while the job runs; its imports
(seconds of a core) run at idle CPU priority until an actor takes the process
(workers.engine_imports.preload), so that they only use cores the ranks leave free.

A rank lost with its node moves to another node (workers.relocate), where the job has no process.
For a job on several nodes without hot spares (a node's loss leaves survivors: the peer path) the
worker group therefore also keeps warm processes on the *standby* nodes: where `relocate` would send
each of the job's nodes' ranks if that node were lost now, one process per rank that would land there
(a TP group moves whole: TP 8 asks for 8), recomputed as other jobs take and free GPUs. With hot
spares the spares cover a node's loss; a job on one node that loses it restores every rank from the
checkpoint, and a node's worth of idle processes is not kept for that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.engine_imports import SETUP_HOOK
from workers.raylets import NodeGone, Raylets

log = logging.getLogger(__name__)

# ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: what runtime_env["worker_process_setup_hook"]
# becomes; set directly so that the runtime env is the same in the actor's options and in the prestart.
SETUP_HOOK_ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
KEEP_ALIVE_S = 600.0  # how long the raylet keeps a started idle process from its idle-worker reaper
CHECK_S = 60.0  # how often the job's idle processes are counted while nothing else changes
MAX_THREADS = 16  # nodes checked at once (a start waits for its processes to register)
WARM_MARGIN_S = 0.05  # a process created this long before its actor was asked for was a warm one


def rank_runtime_env(env_vars: Mapping[str, str]) -> dict[str, Any]:
    """The runtime env of a job's rank actors: its environment, and the hook that imports the engine."""
    return {"env_vars": {**env_vars, SETUP_HOOK_ENV_VAR: SETUP_HOOK}}


class WarmWorkers:
    """One job's warm processes. `keep` and `release` are called from the controller's loop; the
    raylet calls run on one background thread at a time (`background=False`: inline), so that an
    unreachable raylet never holds up the controller, and a newer request replaces one not yet run."""

    def __init__(self, runtime_env: Mapping[str, Any], per_node: int = 1, *,
                 keep_alive_s: float = KEEP_ALIVE_S, check_s: float = CHECK_S,
                 raylets: Raylets | None = None, clock: Callable[[], float] = time.monotonic,
                 background: bool = True) -> None:
        self.runtime_env = dict(runtime_env)
        self.per_node = max(0, int(per_node))
        self.keep_alive_s, self.check_s = keep_alive_s, check_s
        self._raylets = raylets
        self.clock = clock
        self.background = background
        self.mine: dict[str, set[int]] = {}  # node id -> pids of this job's idle processes there, last seen
        self.want: dict[str, int] = {}  # node id -> how many were last asked to be kept there
        self._checked_at = float("-inf")
        self._backoff: dict[str, float] = {}  # node id -> not asked to start processes before then
        self._errors: dict[str, str] = {}  # node id -> the last failure logged for it
        self._lock = threading.Lock()
        self._next: dict[str, int] | None = None  # the request the background thread runs next
        self._thread: threading.Thread | None = None

    @property
    def raylets(self) -> Raylets:
        if self._raylets is None:
            from workers.raylets import RayRaylets

            self._raylets = RayRaylets()
        return self._raylets

    def keep(self, node_ids: Collection[str], standby: Mapping[str, int] | None = None) -> list[str]:
        """Keep `per_node` warm processes on each of the job's nodes (`node_ids`) and, on `standby`
        nodes (where ranks would move if one of the job's nodes were lost: workers.relocate), one for
        each rank that would land there. Checked when that changes, after `taken`, and every
        CHECK_S; the nodes checked now ([] when not due)."""
        if self.per_node == 0:
            return []
        want = dict.fromkeys(node_ids, self.per_node)
        for node, n in (standby or {}).items():
            want[node] = max(want.get(node, 0), int(n))
        now = self.clock()
        if want == self.want and now - self._checked_at < self.check_s:
            return []
        self.want, self._checked_at = want, now
        self._request(want)
        with self._lock:
            return sorted(set(want) | set(self.mine))

    def taken(self, node_ids: Collection[str]) -> None:
        """New actors started on these nodes (replacements, ranks): they may have taken warm processes;
        the next `keep` counts again."""
        with self._lock:
            ours = set(self.want) | set(self.mine)
        if set(node_ids) & ours:
            self._checked_at = float("-inf")

    def release(self, wait_s: float = 30.0) -> None:
        """The job is over: end its idle processes on every node, on the caller's thread (the
        controller's last act; a process left behind would idle until the raylet reaps it), after
        the check in flight (at most `wait_s`)."""
        self.want, self._checked_at = {}, float("-inf")
        with self._lock:
            self._next, thread = None, self._thread
        if thread is not None:
            thread.join(wait_s)
        self._sync({})

    def describe(self) -> dict[str, int]:
        """Node id -> this job's idle processes there, as last counted."""
        with self._lock:
            return {node: len(pids) for node, pids in sorted(self.mine.items())}

    def settle(self, timeout_s: float) -> bool:
        """Wait for the background checks to finish; whether they did."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return not (thread and thread.is_alive())

    # ---- the raylet calls ---------------------------------------------------------------------------
    def _request(self, want: dict[str, int]) -> None:
        if not self.background:
            self._sync(want)
            return
        with self._lock:
            self._next = want
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lattice-warm-workers", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                want, self._next = self._next, None
                if want is None:
                    self._thread = None
                    return
            self._sync(want)

    def _sync(self, want: Mapping[str, int]) -> None:
        with self._lock:
            nodes = sorted(set(want) | set(self.mine))
        if not nodes:
            return
        with ThreadPoolExecutor(min(MAX_THREADS, len(nodes)), thread_name_prefix="lattice-warm") as pool:
            for node, error in zip(nodes, pool.map(lambda n: self._sync_node(n, want.get(n, 0)), nodes),
                                   strict=True):
                if error and self._errors.get(node) != error:  # once, not at every check
                    log.warning("warm worker processes on node %s: %s", node[:12], error)
                if error:
                    self._errors[node] = error
                else:
                    self._errors.pop(node, None)

    def _sync_node(self, node: str, n: int) -> str | None:
        """Make this job's idle processes on `node` number `n`; why not, or None. A node that did not
        start what it was asked for is not asked again before the keep-alive ends (processes that
        registered late are not counted as this job's: asking again each check would pile them up)."""
        with self._lock:
            mine = set(self.mine.get(node, ()))
        error = None
        try:
            idle = self.raylets.idle(node)
            mine &= idle
            if len(mine) < n and self.clock() >= self._backoff.get(node, float("-inf")):
                short = n - len(mine)
                started = self.raylets.prestart(node, short, self.runtime_env, self.keep_alive_s, idle)
                if len(started) < short:
                    error = f"{short} process(es) asked, {len(started)} registered in time"
                    self._backoff[node] = self.clock() + self.keep_alive_s
                mine |= started
            elif len(mine) > n:
                mine -= self.raylets.drain(node, len(mine) - n, self.runtime_env)
                mine = set(sorted(mine)[:n])  # one ended was not among ours (another job's, same env)
        except NodeGone as e:  # its processes went with it; wanted again if it comes back
            error, mine = f"{e}: none kept there", set()
        except Exception as e:  # noqa: BLE001 - Ray's internal API: a replacement then starts cold
            error = f"{type(e).__name__}: {str(e)[:200]}"
            if len(mine) < n:
                self._backoff[node] = self.clock() + self.keep_alive_s
        with self._lock:
            if mine:
                self.mine[node] = mine
            else:
                self.mine.pop(node, None)
        return error


def started_warm(actor: Any, asked_at: float, timeout_s: float) -> bool | None:
    """Whether `actor` (a RankActor asked for at `asked_at`, wall clock) runs in a process created
    before it was asked for; None when that cannot be told (the actor died since)."""
    import ray

    try:
        since = ray.get(actor.process_since.remote(), timeout=timeout_s)
    except Exception as e:  # noqa: BLE001 - a rank that died since
        log.debug("no process start time: %s", e)
        return None
    return since is not None and since < asked_at - WARM_MARGIN_S


__all__ = ["CHECK_S", "KEEP_ALIVE_S", "SETUP_HOOK_ENV_VAR", "WarmWorkers", "rank_runtime_env", "started_warm"]
