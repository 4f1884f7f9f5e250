"""The Ray cluster Lattice runs on: an embedded local one, or an existing one by address.

Embedded (`lattice serve` with no Ray address, the demo, the tests): one head node without GPUs
(it hosts the driver and the job controllers) plus `racks x nodes_per_rack` simulated nodes on
this machine, each a real raylet with `gpus_per_node` virtual GPUs (Ray's "GPU" resource on CPU)
and the labels a production node gets from `ray start --labels`: {"rack": "r1", "node_name":
"r1-n1"}. Ray's session files go under `temp_dir` (default `.lattice/ray`). Every process of the
embedded cluster (GCS, raylets, object managers, workers, dashboard and runtime-env agents, metrics
export) binds to `host`, loopback by default: Ray has no authentication of its own, and anyone who
reaches its ports can run code as this user (docs/security.md).

Production: `connect(address)` joins a cluster whose nodes were started with, e.g.,
`ray start --address=<head>:6379 --labels='{"rack": "r1"}'`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from workers.names import NAMESPACE

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# A dead node is declared after ~period x threshold instead of Ray's ~30 s default, so that a node
# death (a kill_node fault) is detected in seconds; the generous timeout keeps a busy 2-core
# machine from failing a live node's health check.
HEALTH_CHECK_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 3000,
    "health_check_failure_threshold": 4,
}


LOOPBACK = "127.0.0.1"


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class EmbeddedClusterConfig:
    racks: int = 2
    nodes_per_rack: int = 2
    gpus_per_node: int = 4
    cpus_per_node: int = 1  # rank actors ask for a fraction of one CPU each
    head_cpus: int = 1
    object_store_mb: int = 100  # per node; the 2-core / 24 GB machines need it small
    temp_dir: str = ".lattice/ray"
    metrics_export_port: int | None = None  # the head node's Prometheus endpoint; None = Ray picks
    namespace: str = NAMESPACE
    host: str = LOOPBACK  # the node IP address every Ray process of the cluster binds to

    def __post_init__(self) -> None:
        for name in ("racks", "nodes_per_rack", "gpus_per_node", "cpus_per_node"):
            if getattr(self, name) < 1:
                raise ClusterError(f"cluster.{name} must be >= 1, got {getattr(self, name)}")
        if self.object_store_mb < 75:
            raise ClusterError(
                f"cluster.object_store_mb must be >= 75 (Ray's minimum), got {self.object_store_mb}"
            )

    def node_names(self) -> list[tuple[str, str]]:
        """(rack, node name) of every simulated node, in order."""
        racks, per_rack = range(1, self.racks + 1), range(1, self.nodes_per_rack + 1)
        return [(f"r{r}", f"r{r}-n{n}") for r in racks for n in per_rack]


@dataclass
class EmbeddedCluster:
    config: EmbeddedClusterConfig
    address: str
    _cluster: Any = field(repr=False)
    _nodes: dict[str, Any] = field(default_factory=dict, repr=False)  # node name -> ray Node
    _killer: Any = field(default=None, repr=False)

    def node_ids(self) -> dict[str, str]:
        """Node name -> Ray node id of the live simulated nodes."""
        import ray

        out = {}
        for n in ray.nodes():
            name = (n.get("Labels") or {}).get("node_name")
            if n.get("Alive") and name:
                out[name] = str(n["NodeID"])
        return out

    def remove_node(self, name: str) -> None:
        """Take a simulated node out of the cluster (a kill_node fault)."""
        node = self._nodes.pop(name, None)
        if node is None:
            raise ClusterError(f"no simulated node named {name!r}; have {', '.join(sorted(self._nodes))}")
        # A machine that loses power takes its worker processes with it; Ray's workers would
        # otherwise outlive their raylet for a while. Kill them first, then the node's daemons.
        roots = [p.process.pid for procs in node.all_processes.values() for p in procs if p.process]
        for pid in descendants(roots):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._cluster.remove_node(node, allow_graceful=False)

    def node_names(self) -> list[str]:
        return sorted(self._nodes)

    def ray_nodes(self) -> list[Any]:
        """The head's and the simulated nodes' ray._private.node.Node objects (their processes)."""
        return [self._cluster.head_node, *self._nodes.values()]

    def serve_node_kills(self) -> Any:
        """Let job controllers remove nodes of this cluster (kill_node faults) through the
        `lattice-node-killer` mailbox, served by a thread of this process (workers.node_killer)."""
        from workers.node_killer import NodeKillService

        if self._killer is None:
            self._killer = NodeKillService(self)
        return self._killer

    def add_node(self, name: str, rack: str, gpus: int | None = None, wait: bool = True) -> None:
        """Add (or bring back) a simulated node with the given labels."""
        if name in self._nodes:
            raise ClusterError(f"node {name!r} is already in the cluster")
        self._nodes[name] = self._cluster.add_node(wait=wait, **_node_args(self.config, rack, name, gpus))

    def shutdown(self) -> None:
        import ray

        if self._killer is not None:
            self._killer.stop()
            self._killer = None
        if ray.is_initialized():
            ray.shutdown()
        self._cluster.shutdown()
        self._nodes.clear()


def descendants(roots: list[int]) -> list[int]:
    """Every descendant process of `roots` (Linux /proc; [] elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4; the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


_descendants = descendants  # the older private name (tests/deploy/test_ray_loopback.py)


def _node_args(cfg: EmbeddedClusterConfig, rack: str, name: str, gpus: int | None = None) -> dict[str, Any]:
    return {
        "num_cpus": cfg.cpus_per_node,
        "num_gpus": cfg.gpus_per_node if gpus is None else gpus,
        "object_store_memory": cfg.object_store_mb * MiB,
        "labels": {"rack": rack, "node_name": name},
        "node_ip_address": cfg.host,
    }


def start_embedded_cluster(
    racks: int = 2,
    nodes_per_rack: int = 2,
    gpus_per_node: int = 4,
    temp_dir: str = ".lattice/ray",
    *,
    cpus_per_node: int = 1,
    head_cpus: int = 1,
    object_store_mb: int = 100,
    metrics_export_port: int | None = None,
    namespace: str = NAMESPACE,
    host: str = LOOPBACK,
    connect_driver: bool = True,
    detached: bool = False,
    timeout_s: float = 120.0,
) -> EmbeddedCluster:
    """Start the head and the simulated nodes (in parallel), wait for all of them, and (by
    default) connect this process as the driver in `namespace`. Every Ray process binds to `host`
    (loopback unless a caller really wants the simulated cluster reachable from elsewhere).
    `detached`: the Ray processes outlive this process (workers.shared_cluster stops them)."""
    from ray._common.utils import get_default_ray_temp_dir
    from ray.cluster_utils import Cluster

    cfg = EmbeddedClusterConfig(
        racks=racks, nodes_per_rack=nodes_per_rack, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
        head_cpus=head_cpus, object_store_mb=object_store_mb, temp_dir=temp_dir,
        metrics_export_port=metrics_export_port, namespace=namespace, host=host,
    )
    root = os.path.abspath(temp_dir)  # Ray wants an absolute path
    os.makedirs(root, exist_ok=True)
    # cluster_utils records the address in Ray's default temp dir; it must exist.
    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    t0 = time.monotonic()
    head_args: dict[str, Any] = {
        "num_cpus": head_cpus,
        "num_gpus": 0,
        "object_store_memory": object_store_mb * MiB,
        "include_dashboard": False,
        "dashboard_host": host,
        "node_ip_address": host,
        "temp_dir": root,
        "labels": {"lattice.role": "head"},
        "_system_config": dict(HEALTH_CHECK_CONFIG),
    }
    if metrics_export_port is not None:
        head_args["metrics_export_port"] = metrics_export_port
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args, shutdown_at_exit=not detached)
        nodes = {}
        for rack, name in cfg.node_names():
            nodes[name] = cluster.add_node(wait=False, **_node_args(cfg, rack, name))
        cluster.wait_for_nodes(timeout=timeout_s)
    except Exception as e:
        raise ClusterError(f"could not start the embedded Ray cluster under {root}: {e}") from e
    log.info(
        "embedded Ray cluster at %s: %d racks x %d nodes x %d GPUs in %.1fs",
        cluster.address, racks, nodes_per_rack, gpus_per_node, time.monotonic() - t0,
    )
    embedded = EmbeddedCluster(config=cfg, address=cluster.address, _cluster=cluster, _nodes=nodes)
    if connect_driver:
        connect(cluster.address, namespace=namespace)
    return embedded


def connect(address: str, namespace: str = NAMESPACE) -> None:
    """Join an existing cluster as a driver (no-op if already connected). A loopback address (the
    embedded cluster's) keeps this driver on loopback too."""
    import ray

    if ray.is_initialized():
        return
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        if _is_loopback(host):
            with _keep_loopback():
                ray.init(address=address, namespace=namespace, log_to_driver=False, _node_ip_address=host)
        else:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
    except Exception as e:
        raise ClusterError(f"could not connect to the Ray cluster at {address!r}: {e}") from e


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextmanager
def _keep_loopback() -> Iterator[None]:
    """While a driver joins a cluster bound to loopback: ray.init swaps a loopback address (of the
    cluster and of the driver) for this machine's network address, so that other machines could
    reach it; nothing of a loopback cluster listens there."""
    from ray._private import services

    original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original
