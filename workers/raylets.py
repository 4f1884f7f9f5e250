"""The raylet calls behind warm worker processes (workers.warm_workers): which idle worker processes
this Ray job has on a node, starting more ahead of need, and ending them.

Ray has no public API for either side: starting uses the raylet's `PrestartWorkers` RPC (the one
Ray's own lease path uses) and counting its `GetNodeStats`; ending one takes it the way Ray hands an
idle process to work, with a throwaway actor of the same runtime env pinned to the node, then kills
that actor (its process exits with it). These are Ray's internal API: callers treat every failure
as "no warm process", never as the job's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Protocol

RPC_TIMEOUT_S = 5.0
REGISTER_TIMEOUT_S = 30.0  # for one batch of started processes to register with the raylet
NODES_STALE_S = 10.0  # how long a lookup of the nodes' addresses is reused


class NodeGone(LookupError):
    """The node is not alive (its processes went with it)."""


class Raylets(Protocol):
    def idle(self, node: str) -> set[int]:
        """The pids of this Ray job's idle worker processes on `node` (no actor in them); NodeGone
        when the node is not alive."""

    def prestart(self, node: str, count: int, runtime_env: Mapping[str, Any], keep_alive_s: float,
                 before: Collection[int]) -> set[int]:
        """Start `count` idle processes with `runtime_env` on `node`; the pids that registered since
        `before` (the idle pids when asked), at most `count`: fewer when some did not register in
        time."""

    def drain(self, node: str, count: int, runtime_env: Mapping[str, Any]) -> set[int]:
        """End up to `count` idle processes with `runtime_env` on `node`; the pids ended."""


class _Drain:
    """Takes one idle worker process (the runtime env it was created with picks which kind) and
    says which; killing the actor then ends that process."""

    def pid(self) -> int:
        return os.getpid()


class RayRaylets:
    """`Raylets` for this process's Ray job (the job of the actors it creates); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: dict[str, dict[str, Any]] = {}
        self._looked_up = float("-inf")
        self._drain_cls: Any = None  # ray.remote(_Drain), made once

    def idle(self, node: str) -> set[int]:
        with self._channel(node) as stub:
            return _idle_on(stub)

    def prestart(self, node: str, count: int, runtime_env: Mapping[str, Any], keep_alive_s: float,
                 before: Collection[int]) -> set[int]:
        """A raylet starts at most its node's CPU count of processes at once and drops the rest of a
        request (Ray's maximum_startup_concurrency, ray._private.services; a simulated node of the
        embedded cluster has one CPU): asked in batches of that size, each once the previous one
        registered (at most REGISTER_TIMEOUT_S each)."""
        from ray._private.utils import get_runtime_env_info
        from ray.core.generated import common_pb2, node_manager_pb2
        from ray.runtime_env import RuntimeEnv

        cap = max(1, int((self._node(node).get("Resources") or {}).get("CPU", 1)))
        env_info = get_runtime_env_info(RuntimeEnv(**runtime_env), is_job_runtime_env=False)
        before, asked = set(before), 0
        new: set[int] = set()
        with self._channel(node) as stub:
            while asked < count:
                batch = min(count - asked, cap)
                stub.PrestartWorkers(node_manager_pb2.PrestartWorkersRequest(
                    language=common_pb2.PYTHON, job_id=_job_id(), runtime_env_info=env_info,
                    keep_alive_duration_secs=int(keep_alive_s), num_workers=batch), timeout=RPC_TIMEOUT_S)
                asked += batch
                deadline = time.monotonic() + REGISTER_TIMEOUT_S
                while len(new := _idle_on(stub) - before) < asked:
                    if time.monotonic() > deadline:  # a stuck node: what registered is what it has
                        return set(sorted(new)[:count])
                    time.sleep(0.25)
        return set(sorted(new)[:count])

    def drain(self, node: str, count: int, runtime_env: Mapping[str, Any]) -> set[int]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._drain_cls is None:
            self._drain_cls = ray.remote(_Drain)
        cls = self._drain_cls.options(num_cpus=0, runtime_env=dict(runtime_env), max_restarts=0,
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        actors = [cls.remote() for _ in range(count)]
        try:
            refs = [a.pid.remote() for a in actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RPC_TIMEOUT_S)
            return {ray.get(r) for r in ready}
        finally:
            for a in actors:  # taken or still starting: its process ends with it
                ray.kill(a, no_restart=True)

    # ---- addresses ------------------------------------------------------------------------------
    def _node(self, node: str) -> dict[str, Any]:
        import ray

        with self._lock:
            if node not in self._nodes or time.monotonic() - self._looked_up > NODES_STALE_S:
                self._nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
                self._looked_up = time.monotonic()
            info = self._nodes.get(node)
        if info is None:
            raise NodeGone("not an alive node")
        return info

    def _channel(self, node: str) -> _Stub:
        return _Stub(self._node(node))


class _Stub:
    """A NodeManagerService stub on a node's raylet, its channel closed on exit."""

    def __init__(self, info: Mapping[str, Any]) -> None:
        self.address = f"{info['NodeManagerAddress']}:{info['NodeManagerPort']}"

    def __enter__(self) -> Any:
        from ray._private.grpc_utils import init_grpc_channel
        from ray.core.generated import node_manager_pb2_grpc

        self.channel = init_grpc_channel(self.address)
        return node_manager_pb2_grpc.NodeManagerServiceStub(self.channel)

    def __exit__(self, *exc: object) -> None:
        self.channel.close()


def _idle_on(stub: Any) -> set[int]:
    """The pids of this Ray job's worker processes with no actor, on the stub's raylet."""
    from ray.core.generated import node_manager_pb2

    reply = stub.GetNodeStats(node_manager_pb2.GetNodeStatsRequest(), timeout=RPC_TIMEOUT_S)
    job = _job_id()
    return {w.pid for w in reply.core_workers_stats
            if w.job_id == job and set(w.actor_id) <= {0xFF}}  # nil actor id: all 0xff


def _job_id() -> bytes:
    import ray

    return bytes.fromhex(ray.get_runtime_context().get_job_id())


__all__ = ["NodeGone", "RayRaylets", "Raylets"]
