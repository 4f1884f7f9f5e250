"""Run a node type's calibration (training.calibration) in this process or as a Ray task on a node.

`lattice calibrate` calls `calibrate_here`; the scheduler (service/scheduler/autocalibrate.py) calls
`calibrate_on_node` with the quick grid, in the background, for a node type it has no profile of.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)


def calibrate_here(node_type: str, *, quick: bool = False, collectives: bool = True) -> dict[str, Any]:
    """The hardware profile document of this machine (training.calibration.calibrate)."""
    from training.calibration import Grid, calibrate
    from training.parallel.dist import default_device

    grid = Grid.quick() if quick else Grid.for_device(default_device())
    if not collectives:
        grid = dataclasses.replace(grid, collectives=False)
    return calibrate(node_type, grid)


def calibrate_on_node(node_type: str, node_id: str | None = None, timeout_s: float = 120.0, *,
                      quick: bool = False, num_gpus: float = 0, num_cpus: float = 1) -> dict[str, Any]:
    """The profile measured by a Ray task on `node_id` (any node when None); RuntimeError when it fails.

    `num_gpus`: what the task holds; on a GPU node it needs one (Ray hides the GPUs from a task that
    asks for none, which would measure the CPU). Ranks compute with one thread (OMP_NUM_THREADS=1, as
    workers/worker_group.py gives them), so the task does too."""
    import ray
    from ray.exceptions import RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_retries": 0,
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    if node_id is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    ref = ray.remote(calibrate_here).options(**options).remote(node_type, quick=quick)
    try:
        return ray.get(ref, timeout=timeout_s)
    except (RayError, TimeoutError) as e:
        try:
            ray.cancel(ref, force=True)  # a task still waiting for its node must not take it later
        except Exception:  # noqa: BLE001 - it has ended already
            log.debug("calibration task of %s: nothing to cancel", node_type)
        raise RuntimeError(f"calibration of {node_type} failed: {e}") from e
