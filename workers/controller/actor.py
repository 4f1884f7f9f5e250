"""One controller per job: the detached, named Ray actor around the state machine.

`start_controller(job_id, run_cfg, ...)` creates `lattice-job-<id>` in namespace "lattice"
(lifetime detached, so it outlives the service process). Its loop thread steps the
`ControllerStateMachine` (workers.controller.machine); `poll`, `cancel`, `update_nodes`,
`inject_fault`, `preempt`, `report` and `trigger` are served concurrently (max_concurrency). After a service
restart the service finds it again with `get_controller(job_id)`. Rank actors and the placement
group are owned by the controller, so they end with it.

The actor wires the state machine to the real world: a `RayWorkerGroup`, the cluster owner's node
killer (workers.node_killer), checkpoint verification on a filesystem the controller sees
(`LocalCheckpointOps`) and a referee on a spare GPU (`RayReferee`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from training.config.run import RunConfig
from workers.controller import preempt
from workers.controller.injection import kill_node
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.scrub import LocalCheckpointOps
from workers.engine_imports import rank_env, warm_imports
from workers.names import NAMESPACE, controller_name, head_node_id
from workers.policies import FailurePolicy, ScalingPolicy
from workers.referee import RayReferee
from workers.spares import unusable_nodes

log = logging.getLogger(__name__)


class ControllerExists(RuntimeError):
    """A controller is already registered under the job's name."""


class JobController:
    """The state machine's loop in a thread of a detached actor; other methods run concurrently."""

    def __init__(
        self,
        job_id: str,
        run_cfg: RunConfig,
        options: ControllerOptions | None = None,
        failure_policy: FailurePolicy | None = None,
        scaling_policy: ScalingPolicy | None = None,
        health: Mapping[str, str] | None = None,
        cordoned: Collection[str] = (),
    ) -> None:
        from workers.worker_group import RayWorkerGroup  # imports Ray

        opts = options or ControllerOptions()
        warm_imports(("training.checkpoint.checkpointer",))  # first scrub: no `import torch` stall
        self._wake = threading.Event()
        self._closed = threading.Event()
        group = RayWorkerGroup(
            job_id,
            cpus_per_rank=opts.cpus_per_rank,
            reserve_timeout_s=opts.reserve_timeout_s,
            start_timeout_s=opts.start_timeout_s,
            poll_timeout_s=opts.rank_poll_timeout_s,
            rendezvous_timeout_s=opts.startup_timeout_s,
            collective_timeout_s=opts.collective_timeout_s,
            train_fn=opts.train_fn,
            flops_per_token=opts.flops_per_token,
            env_vars=rank_env(opts.env_vars, run_cfg.layout.pp),
            should_stop=lambda: self._sm.cancel_requested,
            log_max_bytes=opts.log_max_bytes,
            log_backups=opts.log_backups,
            spares=opts.spares,
            warm_workers=opts.warm_workers,
            warm_standby=opts.warm_standby,
            spare_exclude=lambda: unusable_nodes(self._sm.attributor.health_view(),
                                                 self._sm.attributor.cordoned, self._sm.attributor.exclude),
        )
        self._sm = ControllerStateMachine(
            job_id, run_cfg, group, options=opts, failure_policy=failure_policy,
            scaling_policy=scaling_policy, health=health, cordoned=cordoned,
            node_killer=kill_node, checkpoint_ops=LocalCheckpointOps(),
            referee=RayReferee(opts.cpus_per_rank, opts.env_vars, spare=group.referee_spare),
        )
        self._thread = threading.Thread(target=self._loop, name=f"lattice-controller-{job_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        sm = self._sm
        while not sm.state.terminal:
            try:
                transition = sm.step()
            except Exception as e:  # never leave a job without a live loop
                log.exception("job %s: controller loop error", sm.job_id)
                transition = sm.fail(f"controller loop error: {type(e).__name__}: {e}")
            if transition is None and not sm.state.terminal:
                self._wake.wait(sm.options.poll_interval_s)
                self._wake.clear()
        linger = sm.options.linger_s
        if linger is not None and not self._closed.wait(linger):
            log.info("job %s: terminal for %.0fs with no one collecting; exiting", sm.job_id, linger)
            import ray

            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def poll(self, since_seq: int = 0) -> dict[str, Any]:
        return self._sm.snapshot(since_seq)

    def state(self) -> str:
        return str(self._sm.state)

    def cancel(self, reason: str = "cancelled by user", wait_s: float = 60.0) -> str:
        """Tear down the ranks and the placement group; returns the state reached."""
        self._sm.request_cancel(reason)
        self._wake.set()
        deadline = time.monotonic() + wait_s
        while not self._sm.state.terminal and time.monotonic() < deadline:
            time.sleep(0.05)
        return str(self._sm.state)

    def update_nodes(self, health: Mapping[str, str], cordoned: Collection[str]) -> None:
        self._sm.update_nodes(health, cordoned)

    def preempt(self, reason: str, grace_s: float = 120.0) -> bool:
        """A preemption notice (workers.controller.preempt): checkpoint at the next step boundary,
        stop, end PREEMPTED; False if the job is already ending or has a notice."""
        with self._sm.log.lock:
            sent = preempt.request(self._sm, reason, grace_s)
        self._wake.set()
        return sent

    def inject_fault(self, kind: str, rank: int | None = None, at_step: int = 0, **params: Any) -> None:
        """Add a fault (workers.faults spec) to the running job; raises FaultError for a bad spec."""
        spec = {"kind": kind, "at_step": at_step, **params}
        if rank is not None:
            spec["rank"] = rank
        self._sm.inject(spec)

    def report(self, rank: int, event: dict[str, Any]) -> None:
        """A rank's event delivered directly (it is about to die and its buffer with it)."""
        self._sm.report(rank, event)

    def trigger(self, rank: int, fault: dict[str, Any]) -> str:
        """A rank reached a controller-side fault (kill_node, corrupt_checkpoint): carry it out."""
        return self._sm.trigger(rank, fault)

    def close(self) -> None:
        """The service has collected the final state; let the actor go."""
        self._closed.set()


def start_controller(
    job_id: str,
    run_cfg: RunConfig,
    *,
    options: ControllerOptions | None = None,
    failure_policy: FailurePolicy | None = None,
    scaling_policy: ScalingPolicy | None = None,
    health: Mapping[str, str] | None = None,
    cordoned: Collection[str] = (),
) -> Any:
    """Create the job's detached controller (on the head node when it can) and return its handle.
    Raises ControllerExists if one is already registered under the job's name."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = controller_name(job_id)
    if get_controller(job_id) is not None:
        raise ControllerExists(f"a controller named {name!r} already exists; attach with get_controller()")
    head = head_node_id()
    # On the head when there is one (never on a GPU node that a fault may take down).
    strategy = NodeAffinitySchedulingStrategy(head, soft=False) if head else "DEFAULT"
    return (
        ray.remote(JobController)
        .options(
            name=name, namespace=NAMESPACE, lifetime="detached", max_concurrency=16,
            num_cpus=0, scheduling_strategy=strategy,
        )
        .remote(job_id, run_cfg, options, failure_policy, scaling_policy, health, cordoned)
    )


def get_controller(job_id: str) -> Any | None:
    """The job's controller handle if it is alive (e.g. after the service restarted), else None."""
    import ray

    try:
        return ray.get_actor(controller_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None


def kill_controller(job_id: str) -> bool:
    """End the controller actor (its rank actors and placement group go with it)."""
    import ray

    handle = get_controller(job_id)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    return True
