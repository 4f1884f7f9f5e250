"""Warm worker processes against real raylets (workers.raylets on the shared embedded Ray cluster): a
job's processes are counted, renewed without piling up, taken by an actor of the same runtime env,
and ended when the job is over (tests.local_procs tells whose a process is by its environment)."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.local_procs import processes_with_env, until
from workers.raylets import RayRaylets
from workers.warm_workers import CHECK_S, WarmWorkers, rank_runtime_env

pytestmark = pytest.mark.ray


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_jobs_warm_process_is_counted_renewed_taken_and_ended(ray_cluster) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.topology import Topology

    run = uuid.uuid4().hex
    marker, env = f"LATTICE_TEST_RAYLETS={run}", rank_runtime_env({"LATTICE_TEST_RAYLETS": run})
    node = Topology.from_ray(include_dead=False).gpu_nodes[0].node_id
    clock = Clock()
    warm = WarmWorkers(env, 1, raylets=RayRaylets(), clock=clock, background=False)
    try:
        warm.keep({node})
        (pid,) = warm.mine[node]
        assert warm.describe() == {node: 1}
        assert processes_with_env(marker) == {pid} and pid in warm.raylets.idle(node)

        for _ in range(3):  # renewals while it is still idle: no second process
            clock.t += CHECK_S + 1
            warm.keep({node})
        assert warm.mine[node] == {pid} and processes_with_env(marker) == {pid}

        @ray.remote(num_cpus=0)
        class Probe:
            def pid(self) -> int:
                return os.getpid()

        probe = Probe.options(runtime_env=env,
                              scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        assert ray.get(probe.pid.remote(), timeout=60) == pid  # Ray handed the warm process to the actor
        warm.taken({node})
        warm.keep({node})
        (fresh,) = warm.mine[node]
        assert fresh != pid and processes_with_env(marker) == {pid, fresh}
        ray.kill(probe, no_restart=True)
        assert until(lambda: processes_with_env(marker) == {fresh})
    finally:
        warm.release()
    assert warm.mine == {}
    assert until(lambda: not processes_with_env(marker)), "the job's idle process outlived its release"


@pytest.mark.parametrize("pp", [1, 2])
def test_a_rank_process_preloads_the_pipeline_engine_only_for_a_job_with_stages(ray_cluster, pp) -> None:
    """The setup hook of a rank process (its job's ranks, warm processes) imports the engine in the
    background; torch's pipelining (torch._dynamo, ~0.7 s of a core) only where the layout has stages."""
    import ray

    from workers.engine_imports import rank_env

    @ray.remote(num_cpus=0)
    class Probe:
        def imported(self) -> dict[str, bool]:
            import sys
            import threading

            from workers import engine_imports

            assert engine_imports.process_started_at is not None, "the setup hook did not run"
            for thread in threading.enumerate():
                if thread.name == "lattice-warm-imports":
                    thread.join(120)
            return {name: name in sys.modules for name in ("training.train", "training.parallel.pipeline")}

    env = rank_runtime_env(rank_env({"LATTICE_TEST_RAYLETS": uuid.uuid4().hex}, pp))
    probe = Probe.options(runtime_env=env).remote()
    try:
        seen = ray.get(probe.imported.remote(), timeout=180)
    finally:
        ray.kill(probe, no_restart=True)
    assert seen == {"training.train": True, "training.parallel.pipeline": pp > 1}
