"""The seam for kill_node faults: the controller asks, the owner of the cluster acts.

A job controller is a Ray actor; it cannot own the `ray.cluster_utils.Cluster` that started the
simulated nodes (that lives in the driver: `lattice serve`, the demo, the tests). So the owner
registers a small named mailbox actor, `lattice-node-killer`, pinned to the head node, and a thread
in the owner's process carries out the requests with `EmbeddedCluster.remove_node`: the node's
raylet and workers are killed without grace, exactly as a machine that loses power, and Ray
reports its actors with `ActorDiedError` / the node as dead.

`request_node_kill(name)` is what a controller calls; it returns False when nobody serves the
mailbox (a production cluster: the controller then kills the job's rank processes on that node
and marks the node dead itself, see workers.controller.injection).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from workers.names import KILLER_NAME, NAMESPACE, head_node_id

log = logging.getLogger(__name__)



class NodeKillerMailbox:
    """Requests from controllers; results from the cluster owner's thread."""

    def __init__(self) -> None:
        self._next = 0
        self._queue: list[tuple[int, str]] = []
        self._done: dict[int, str | None] = {}

    def request(self, node: str) -> int:
        self._next += 1
        self._queue.append((self._next, node))
        return self._next

    def take(self) -> list[tuple[int, str]]:
        out, self._queue = self._queue, []
        return out

    def finish(self, request_id: int, error: str | None) -> None:
        self._done[request_id] = error

    def result(self, request_id: int) -> tuple[bool, str | None]:
        if request_id in self._done:
            return True, self._done.pop(request_id)
        return False, None


class NodeKillService:
    """Serves the mailbox from the process that owns the embedded cluster."""

    def __init__(self, cluster: Any, poll_s: float = 0.1) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.cluster = cluster
        self.poll_s = poll_s
        head = head_node_id()
        strategy = NodeAffinitySchedulingStrategy(head, soft=True) if head else "DEFAULT"
        self.mailbox = ray.remote(NodeKillerMailbox).options(
            name=KILLER_NAME, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=strategy,
            get_if_exists=True,
        ).remote()
        self.killed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lattice-node-killer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                requests = ray.get(self.mailbox.take.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 - the cluster is shutting down
                log.debug("node killer: %s", e)
                if self._stop.wait(1.0):
                    return
                continue
            for request_id, node in requests:
                error = None
                try:
                    node_id = self.cluster.node_ids().get(node)
                    self.cluster.remove_node(node)
                    self.killed.append(node)
                    log.warning("node %s removed from the cluster (kill_node fault)", node)
                    self._wait_dead(node_id)
                except Exception as e:  # noqa: BLE001 - reported back to the controller
                    error = f"{type(e).__name__}: {e}"
                self.mailbox.finish.remote(request_id, error)
            self._stop.wait(self.poll_s)

    def _wait_dead(self, node_id: str | None, timeout_s: float = 30.0) -> None:
        """Until Ray declares the node dead (its health checks, ~5 s here): a node brought back
        under the same name must not meet a ghost of itself that still looks alive."""
        import ray

        deadline = time.monotonic() + timeout_s
        while node_id and time.monotonic() < deadline:
            if not any(str(n["NodeID"]) == node_id and n.get("Alive") for n in ray.nodes()):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        import ray

        self._stop.set()
        self._thread.join(timeout=5)
        try:
            ray.kill(self.mailbox, no_restart=True)
        except Exception as e:  # noqa: BLE001 - gone with the cluster
            log.debug("node killer mailbox: %s", e)


def request_node_kill(node: str, timeout_s: float = 60.0) -> bool:
    """Ask the cluster owner to remove `node`; True once done, False if nobody serves the mailbox.
    Raises RuntimeError when the owner tried and failed."""
    import ray

    try:
        mailbox = ray.get_actor(KILLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return False
    request_id = ray.get(mailbox.request.remote(node), timeout=10)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, error = ray.get(mailbox.result.remote(request_id), timeout=10)
        if done:
            if error:
                raise RuntimeError(f"could not remove node {node}: {error}")
            return True
        time.sleep(0.1)
    raise RuntimeError(f"node {node} was not removed within {timeout_s:.0f}s")
