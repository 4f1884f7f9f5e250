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
"""

from __future__ import annotations

import logging
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
WARM_MARGIN_S = 0.05  # a process created this long before its actor was asked for was a warm one


def rank_runtime_env(env_vars: Mapping[str, str]) -> dict[str, Any]:
    """The runtime env of a job's rank actors: its environment, and the hook that imports the engine."""
    return {"env_vars": {**env_vars, SETUP_HOOK_ENV_VAR: SETUP_HOOK}}


# prestart(node_id, runtime_env, count, keep_alive_s): start `count` idle worker processes on the node.
Prestart = Callable[[str, Mapping[str, Any], int, float], None]


class WarmWorkers:
    """One job's warm processes: which nodes were asked for one, and when (not thread-safe: the
    worker group calls it from the controller's loop)."""

    def __init__(self, runtime_env: Mapping[str, Any], per_node: int = 1, *,
                 keep_alive_s: float = KEEP_ALIVE_S, prestart: Prestart | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime_env = dict(runtime_env)
        self.per_node = max(0, int(per_node))
        self.keep_alive_s = keep_alive_s
        self.prestart = prestart or ray_prestart
        self.clock = clock
        self.asked: dict[str, float] = {}  # node id -> when its warm processes were asked for

    def keep(self, node_ids: Collection[str]) -> list[str]:
        """Ask for `per_node` warm processes on each node that has none: never asked, taken since
        (`taken`), or asked for so long ago that the keep-alive is running out. The nodes asked."""
        if self.per_node == 0:
            return []
        now, asked = self.clock(), []
        for node in sorted(set(node_ids)):
            at = self.asked.get(node)
            if at is not None and now - at < 0.9 * self.keep_alive_s:
                continue
            try:
                self.prestart(node, self.runtime_env, self.per_node, self.keep_alive_s)
            except Exception as e:  # noqa: BLE001 - Ray's internal API: a replacement then starts cold
                log.warning("no warm worker process on node %s: %s", node[:12], e)
            self.asked[node] = now  # asked (or failed): not again before the keep-alive runs out
            asked.append(node)
        return asked

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


def ray_prestart(node_id: str, runtime_env: Mapping[str, Any], count: int, keep_alive_s: float) -> None:
    """The raylet's PrestartWorkers RPC for this process's Ray job (the job of the actors it creates)."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.utils import get_runtime_env_info
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
    from ray.runtime_env import RuntimeEnv

    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
    if node is None:
        raise LookupError("not an alive node")
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, job_id=bytes.fromhex(ray.get_runtime_context().get_job_id()),
            runtime_env_info=get_runtime_env_info(RuntimeEnv(**runtime_env), is_job_runtime_env=False),
            keep_alive_duration_secs=int(keep_alive_s), num_workers=count)
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=RPC_TIMEOUT_S)
    finally:
        channel.close()


__all__ = ["KEEP_ALIVE_S", "SETUP_HOOK_ENV_VAR", "WarmWorkers", "rank_runtime_env", "ray_prestart",
           "started_warm"]
