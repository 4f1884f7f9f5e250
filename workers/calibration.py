"""Run a node type's calibration (training.calibration) in this process or as a Ray task on a node.

`lattice calibrate` calls `calibrate_here`; the scheduler (service/scheduler/autocalibrate.py) calls
`calibrate_on_node` with the quick grid, in the background, for a node type it has no profile of, and
`measure_link` between two nodes of that type when it has two: the inter-node tier.
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


class _LinkRank:
    """One end of an inter-node link measurement, a Ray actor pinned to its node."""

    def address(self) -> tuple[str, int]:
        """Where the other end reaches this one: this node's IP and a free port on it."""
        import ray

        from training.parallel.dist import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def run(self, rank: int, master: tuple[str, int], grid: Any, timeout_s: float) -> dict[str, Any]:
        from training.calibration.measure import link_rank

        return link_rank(rank, master[0], master[1], grid, timeout_s)


def measure_link(node_a: str, node_b: str, timeout_s: float = 120.0, *, num_gpus: float = 0,
                 num_cpus: float = 1) -> dict[str, Any]:
    """{backend, collectives: kind -> [(bytes, seconds)]} between one rank on Ray node `node_a` and one on
    `node_b` (the quick grid's messages), over the backend the ranks use: the inter-node link tier.
    RuntimeError when it fails. Each end holds `num_gpus` (on a GPU node, one: NCCL needs it)."""
    import ray
    from ray.exceptions import RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from training.calibration import Grid

    grid = dataclasses.replace(Grid.quick(), engine_points=0)
    ends = [ray.remote(_LinkRank).options(
        num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in (node_a, node_b)]  # fmt: skip
    try:
        master = ray.get(ends[0].address.remote(), timeout=timeout_s)
        refs = [end.run.remote(rank, master, grid, timeout_s) for rank, end in enumerate(ends)]
        result = ray.get(refs, timeout=timeout_s)[0]
    except (RayError, TimeoutError) as e:
        raise RuntimeError(f"link measurement between nodes {node_a} and {node_b} failed: {e}") from e
    finally:
        for end in ends:
            ray.kill(end)
    return {"backend": result["backend"], "collectives": result["collectives"]}
