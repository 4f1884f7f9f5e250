"""Run a node type's calibration (training.calibration) in this process or as a Ray task on a node.

`lattice calibrate` calls `calibrate_here`; the scheduler (or a service) would call `calibrate_on_node`
for a node type it has no profile of, at low priority (one CPU, the node's resource label).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def calibrate_here(node_type: str, *, quick: bool = False, collectives: bool = True) -> dict[str, Any]:
    """The hardware profile document of this machine (training.calibration.calibrate)."""
    from training.calibration import Grid, calibrate

    grid = Grid.quick() if quick else Grid()
    if not collectives:
        grid = Grid(**{**grid.__dict__, "collectives": False})
    return calibrate(node_type, grid)


def calibrate_on_node(node_type: str, node_id: str | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
    """The profile measured by a Ray task on `node_id` (any node when None); RuntimeError when it fails."""
    import ray
    from ray.exceptions import RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=1)(calibrate_here)
    if node_id is not None:
        task = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    try:
        return ray.get(task.remote(node_type), timeout=timeout_s)
    except (RayError, TimeoutError) as e:
        raise RuntimeError(f"calibration of {node_type} failed: {e}") from e
