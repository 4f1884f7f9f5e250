"""Fault tests share the session's local Ray cluster (tests/ray_fixture.py) and let job
controllers remove its simulated nodes (kill_node) through the node-killer mailbox."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ray_fixture import ray_cluster
from workers.topology import Topology

__all__ = ["node_killer", "ray_cluster"]


@pytest.fixture(scope="session")
def node_killer(ray_cluster: Any) -> Any:
    return ray_cluster.serve_node_kills()


@pytest.fixture
def revive_nodes(ray_cluster: Any, node_killer: Any) -> Iterator[Any]:
    """After the test, bring back every node it removed (same name and rack) for later tests."""
    yield node_killer
    racks = {name: rack for rack, name in ray_cluster.config.node_names()}
    revived = False
    for name in list(node_killer.killed):
        if name not in ray_cluster.node_names():
            ray_cluster.add_node(name, racks[name])
            revived = True
    node_killer.killed.clear()
    if revived:  # every simulated node alive once, with all its GPUs free
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            topo = Topology.from_ray(include_dead=False)
            gpus = ray_cluster.config.gpus_per_node * len(racks)
            if len(topo.gpu_nodes) == len(racks) and topo.gpus_free == topo.gpus_total == gpus:
                break
            time.sleep(0.2)


@pytest.fixture
def two_free_gpus_per_node():
    """Hold two GPUs of every node, so that a job puts each pair of consecutive ranks (a TP 2 x DP 2
    replica, an HSDP replicate group of two) on its own node."""
    from ray.util.placement_group import placement_group

    from workers.placement import NODE_ID_LABEL, release
    from workers.topology import Topology

    nodes = Topology.from_ray(include_dead=False).gpu_nodes
    pg = placement_group([{"GPU": 1.0}] * (2 * len(nodes)), strategy="PACK",
                         bundle_label_selector=[{NODE_ID_LABEL: n.node_id} for n in nodes for _ in range(2)])
    assert pg.wait(timeout_seconds=60)
    yield
    release(pg)
