"""One local Ray cluster (2 racks x 2 nodes x 4 virtual GPUs) for the whole test session."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    from workers.cluster import start_embedded_cluster

    # A short root: Ray's unix socket paths under it must stay below ~107 bytes.
    root = tempfile.mkdtemp(prefix="lray-")
    cluster = start_embedded_cluster(racks=2, nodes_per_rack=2, gpus_per_node=4, temp_dir=root)
    try:
        yield cluster
    finally:
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
