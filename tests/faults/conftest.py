"""Fault tests share the session's local Ray cluster (tests/ray_fixture.py) and let job
controllers remove its simulated nodes (kill_node) through the node-killer mailbox."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.ray_fixture import ray_cluster

__all__ = ["node_killer", "ray_cluster"]


@pytest.fixture(scope="session")
def node_killer(ray_cluster: Any) -> Any:
    return ray_cluster.serve_node_kills()


@pytest.fixture
def revive_nodes(ray_cluster: Any, node_killer: Any) -> Iterator[Any]:
    """After the test, bring back every node it removed (same name and rack) for later tests."""
    yield node_killer
    racks = {name: rack for rack, name in ray_cluster.config.node_names()}
    for name in list(node_killer.killed):
        if name not in ray_cluster.node_names():
            ray_cluster.add_node(name, racks[name])
    node_killer.killed.clear()
