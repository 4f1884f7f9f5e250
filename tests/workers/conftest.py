"""Ray tests share one local Ray cluster with every Ray-using test package (tests/ray_fixture.py)."""

from __future__ import annotations

from tests.ray_fixture import ray_cluster

__all__ = ["ray_cluster"]
