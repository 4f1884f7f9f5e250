"""Warm worker processes: idle Ray workers with torch and the engine already imported, kept on a job's
nodes, so that a replacement rank without a hot spare does not import torch on the recovery path.

Every rank actor of a job (and its spares) is created with `rank_runtime_env(env)`: the job's
environment and Ray's worker setup hook, `workers.engine_imports.preload`, which a worker process
started for that runtime env runs before it takes any work. `WarmWorkers.keep(nodes)` asks the raylet
of each node for one such process ahead of need (its `PrestartWorkers` RPC, the one Ray's own lease
path uses, with a keep-alive so that the idle process is not reaped); Ray hands an idle process whose
runtime env matches to the next actor created with it, which then answers in ~0.1 s instead of
spending seconds starting a process and importing torch. Without a warm process (none asked for
yet, or the RPC failed: it is Ray's internal API, so a failure is logged and never raised) the actor
starts cold, as before. Costs: one idle process per node (a few hundred MB of host memory) while the
job runs; its imports take a core for a few seconds, while the ranks rendezvous and build the model.

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
from typing import Any

from workers.engine_imports import SETUP_HOOK

log = logging.getLogger(__name__)

# ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: what runtime_env["worker_process_setup_hook"]
# becomes; set directly so that the runtime env is the same in the actor's options and in the prestart.
SETUP_HOOK_ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"
KEEP_ALIVE_S = 600.0  # how long the raylet keeps an idle warm process from its idle-worker reaper
RPC_TIMEOUT_S = 5.0
REGISTER_TIMEOUT_S = 30.0  # for one batch of processes to register (see ray_prestart)
WARM_MARGIN_S = 0.05  # a process created this long before its actor was asked for was a warm one


def rank_runtime_env(env_vars: Mapping[str, str]) -> dict[str, Any]:
    """The runtime env of a job's rank actors: its environment, and the hook that imports the engine."""
    return {"env_vars": {**env_vars, SETUP_HOOK_ENV_VAR: SETUP_HOOK}}


# prestart({node id: count}, runtime_env, keep_alive_s) -> {node id: error} for the nodes it failed on:
# start `count` idle worker processes with that runtime env on each node.
Prestart = Callable[[Mapping[str, int], Mapping[str, Any], float], Mapping[str, str]]


class WarmWorkers:
    """One job's warm processes: which nodes were asked for how many, and when (not thread-safe: the
    worker group calls it from the controller's loop). The raylet calls run on a background thread
    (`background=False`: inline), so that an unreachable raylet never holds up the controller."""

    def __init__(self, runtime_env: Mapping[str, Any], per_node: int = 1, *,
                 keep_alive_s: float = KEEP_ALIVE_S, prestart: Prestart | None = None,
                 clock: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.runtime_env = dict(runtime_env)
        self.per_node = max(0, int(per_node))
        self.keep_alive_s = keep_alive_s
        self.prestart = prestart or ray_prestart
        self.clock = clock
        self.background = background
        self.asked: dict[str, tuple[float, int]] = {}  # node id -> (when, how many) its processes were asked

    def keep(self, node_ids: Collection[str], standby: Mapping[str, int] | None = None) -> list[str]:
        """Ask for `per_node` warm processes on each of the job's nodes (`node_ids`) and, on `standby`
        nodes (where ranks would move if one of the job's nodes were lost: workers.relocate), one for
        each rank that would land there. A node is asked again once its processes were taken
        (`taken`), when it now needs more, or when the keep-alive is running out. The nodes asked."""
        if self.per_node == 0:
            return []
        want = dict.fromkeys(node_ids, self.per_node)
        for node, n in (standby or {}).items():
            want[node] = max(want.get(node, 0), int(n))
        now, ask = self.clock(), {}
        for node in sorted(want):
            at, had = self.asked.get(node, (None, 0))
            if at is not None and now - at < 0.9 * self.keep_alive_s and had >= want[node]:
                continue
            ask[node] = want[node]
            self.asked[node] = (now, want[node])  # asked (or failed): not again before the keep-alive ends
        if ask:
            if self.background:
                threading.Thread(target=self._prestart, args=(ask,), name="lattice-warm-workers",
                                 daemon=True).start()
            else:
                self._prestart(ask)
        return list(ask)

    def _prestart(self, ask: Mapping[str, int]) -> None:
        try:
            failed = dict(self.prestart(ask, self.runtime_env, self.keep_alive_s))
        except Exception as e:  # noqa: BLE001 - Ray's internal API: a replacement then starts cold
            failed = dict.fromkeys(ask, str(e))
        for node, why in sorted(failed.items()):
            log.warning("no warm worker process on node %s: %s", node[:12], why)

    def taken(self, node_ids: Collection[str]) -> None:
        """New actors started on these nodes (replacements): their warm processes are used up."""
        for node in node_ids:
            self.asked.pop(node, None)


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


def ray_prestart(ask: Mapping[str, int], runtime_env: Mapping[str, Any],
                 keep_alive_s: float) -> dict[str, str]:
    """The raylets' PrestartWorkers RPC for this process's Ray job (the job of the actors it creates):
    one lookup of the nodes' addresses, then calls per node. {node id: error} where it failed.

    A raylet starts at most its node's CPU count of processes at once and drops the rest of a request
    (Ray's maximum_startup_concurrency, ray._private.services; a simulated node of the embedded
    cluster has one CPU), so a node asked for more gets them in batches, each once the last batch's
    processes have registered with its raylet (GetNodeStats; at most REGISTER_TIMEOUT_S each)."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    env_info = get_runtime_env_info(RuntimeEnv(**runtime_env), is_job_runtime_env=False)
    job_id = bytes.fromhex(ray.get_runtime_context().get_job_id())
    failed: dict[str, str] = {}
    for node, count in sorted(ask.items()):
        info = nodes.get(node)
        if info is None:
            failed[node] = "not an alive node"
            continue
        cap = max(1, int((info.get("Resources") or {}).get("CPU", 1)))
        channel = init_grpc_channel(f"{info['NodeManagerAddress']}:{info['NodeManagerPort']}")
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)

        def idle(stub: Any = stub) -> set[int]:  # this job's worker processes on the node with no actor
            reply = stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(), timeout=RPC_TIMEOUT_S)
            return {w.pid for w in reply.core_workers_stats
                    if w.job_id == job_id and set(w.actor_id) <= {0xFF}}  # nil actor id: all 0xff

        try:
            before = idle() if count > cap else set()
            asked = 0
            while asked < count:
                batch = min(count - asked, cap)
                stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
                    language=common_pb2.PYTHON, job_id=job_id, runtime_env_info=env_info,
                    keep_alive_duration_secs=int(keep_alive_s), num_workers=batch), timeout=RPC_TIMEOUT_S)
                asked += batch
                deadline = time.monotonic() + REGISTER_TIMEOUT_S
                while asked < count and len(idle() - before) < asked:  # the batch before the next one
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{asked} process(es) asked, "
                                           f"{len(idle() - before)} registered in {REGISTER_TIMEOUT_S:.0f}s")
                    time.sleep(0.25)
        except Exception as e:  # noqa: BLE001 - one raylet's failure is that node's; the others are asked
            failed[node] = str(e)[:200]
        finally:
            channel.close()
    return failed


__all__ = ["KEEP_ALIVE_S", "SETUP_HOOK_ENV_VAR", "WarmWorkers", "rank_runtime_env", "ray_prestart",
           "started_warm"]
