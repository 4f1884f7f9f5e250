"""A spare rank on a healthy node that referees two replicas disagreeing persistently.

The ranks of a DP = 2 job whose re-run from the pre-step snapshot disagreed again write that
snapshot (training.train, training.integrity.referee) and name it in the integrity error's evidence. The
controller hands it to `RayReferee`: a warm hot spare of the job (workers.spares) outside the
suspects when it has one, else one spare process (`num_gpus=1`, like a rank) started on a
schedulable node outside them, replays the step alone and returns the fingerprint every healthy
replica must have. `decide` turns it into the culprit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

from training.config.run import RunConfig
from workers.topology import Topology

log = logging.getLogger(__name__)


def choose_spare_node(topology: Topology, exclude: Collection[str]) -> str | None:
    """A schedulable node with a free GPU outside `exclude` (node names or ids), by name."""
    nodes = [n for n in topology.schedulable_nodes(exclude) if n.gpus_free > 0]
    return min(nodes, key=lambda n: n.name).name if nodes else None


def _replay(cfg_dict: dict[str, Any], snapshot: str) -> dict[str, Any]:
    """Runs in the spare process: the same thread count as a rank, then the replay."""
    import torch

    from training.integrity.referee import replay_step

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    return replay_step(RunConfig.from_dict(cfg_dict), snapshot)


class RayReferee:
    """`referee(run_cfg, request, exclude)` -> {"fingerprint", "node", "step"} or {"error"}."""

    def __init__(self, cpus: float = 0.1, env_vars: Mapping[str, str] | None = None,
                 timeout_s: float = 300.0, spare: Callable[[Collection[str]], Any] | None = None) -> None:
        """`spare(exclude)`: a warm spare rank actor outside `exclude` taken from the job's pool, or
        None (then a process is started on demand)."""
        self.cpus = cpus
        self.env_vars = {"OMP_NUM_THREADS": "1", **(env_vars or {})}
        self.timeout_s = timeout_s
        self.spare = spare

    def __call__(
        self, run_cfg: RunConfig, request: Mapping[str, Any], exclude: Collection[str]
    ) -> dict[str, Any]:
        warm = self.spare(exclude) if self.spare is not None else None
        if warm is not None:
            out = self._on_spare(warm, run_cfg, request)
            if "fingerprint" in out:
                return out
        return self._on_demand(run_cfg, request, exclude)

    def _on_spare(self, handle: Any, run_cfg: RunConfig, request: Mapping[str, Any]) -> dict[str, Any]:
        """Replay on a warm spare (imports done); the spare is used up (its pool refills)."""
        import ray

        try:
            where = ray.get(handle.where.remote(), timeout=self.timeout_s)
            out = ray.get(handle.replay.remote(run_cfg.to_dict(), str(request["snapshot"])),
                          timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a spare that cannot replay: one started on demand
            log.warning("referee on a warm spare failed: %s", e)
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("kill the referee spare: %s", e)
        return {**out, "node": where["node_name"], "warm_spare": True}

    def _on_demand(
        self, run_cfg: RunConfig, request: Mapping[str, Any], exclude: Collection[str]
    ) -> dict[str, Any]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        topology = Topology.from_ray(include_dead=False)
        name = choose_spare_node(topology, exclude)
        if name is None:
            return {"error": "no free GPU on a healthy node outside the suspects for a spare"}
        node = topology.node(name)
        remote = ray.remote(_replay).options(
            num_gpus=1, num_cpus=self.cpus, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            runtime_env={"env_vars": dict(self.env_vars)},
        )
        try:
            out = ray.get(remote.remote(run_cfg.to_dict(), str(request["snapshot"])), timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a referee that cannot run names nobody
            log.warning("referee on %s failed: %s", name, e)
            return {"error": f"{type(e).__name__}: {e}", "node": name}
        return {**out, "node": name}


def decide(request: Mapping[str, Any], result: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """(culprits, healthy) from the replicas' fingerprints in `request` and the referee's result."""
    from training.integrity.referee import verdict

    if "fingerprint" not in result:
        return [], []
    prints = {int(r): str(f) for r, f in (request.get("fingerprints") or {}).items()}
    return verdict(prints, str(result["fingerprint"]))
