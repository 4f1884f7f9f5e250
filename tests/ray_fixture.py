"""One local Ray cluster (2 racks x 2 nodes x 4 virtual GPUs) for the whole test session.

A process can `ray.init` only once, so every test package that needs Ray (tests/workers,
tests/e2e, ...) imports the `ray_cluster` fixture from here into its conftest. Each import
registers a fixture of its own, but all of them hand out the same cluster: it is started on
first use and shut down once, when the test session ends.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

_lock = threading.Lock()
_cluster: Any = None
_root: str | None = None


def shared_ray_cluster() -> Any:
    """The session's embedded cluster (started on first call)."""
    global _cluster, _root
    with _lock:
        if _cluster is None:
            from workers.cluster import start_embedded_cluster

            # A short root: Ray's unix socket paths under it must stay below ~107 bytes.
            _root = tempfile.mkdtemp(prefix="lray-")
            _cluster = start_embedded_cluster(racks=2, nodes_per_rack=2, gpus_per_node=4, temp_dir=_root)
            atexit.register(shutdown_shared_ray_cluster)
        return _cluster


def shutdown_shared_ray_cluster() -> None:
    global _cluster, _root
    with _lock:
        if _cluster is not None:
            _cluster.shutdown()
            _cluster = None
        if _root is not None:
            shutil.rmtree(_root, ignore_errors=True)
            _root = None


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    try:
        yield shared_ray_cluster()
    finally:
        # Session fixtures end with the session; the first of the importers' copies to end stops it.
        shutdown_shared_ray_cluster()
