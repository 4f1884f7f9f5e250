"""The controller client: the one place the service talks to job controllers and the Ray cluster.

The service never imports Ray. It starts, finds, polls, cancels and ends a job's detached
controller, and reads the live topology, through this module; Ray's errors are turned into
Lattice's at this boundary (`raise ControllerGone(...) from actor_error`):

- `ControllerGone`: the controller actor is dead or was never there (its job must be recovered);
- `ControllerBusy`: it did not answer in time or is unreachable for now (retry on the next tick);
- `ControllerFailed`: the call reached the controller and raised there (a controller bug, or a
  request it refused, e.g. a bad fault spec);
- `ControllerStartError`: Ray refused to create the controller actor;
- `ControllerExists`: a controller is already registered under the job's name (attach to it);
- `ClusterUnavailable`: the cluster could not be read (not connected, GCS unreachable).

    client = start_controller(job_id, run_cfg, options=..., failure_policy=...)
    snapshot = client.poll(since_seq, timeout_s=10)     # ControllerState(snapshot["state"])
    client.cancel("cancelled through the API")
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError

from training.config.run import RunConfig
from workers.controller import ControllerExists, ControllerOptions, ControllerState, get_controller
from workers.controller import start_controller as _start_actor
from workers.names import NAMESPACE, controller_name
from workers.policies import FailurePolicy, ScalingPolicy
from workers.topology import Topology

log = logging.getLogger(__name__)

__all__ = [
    "ClusterUnavailable", "ControllerBusy", "ControllerClient", "ControllerError", "ControllerExists",
    "ControllerFailed", "ControllerGone", "ControllerOptions", "ControllerStartError", "ControllerState",
    "controller_job_ids", "find_controller", "is_connected", "kill_controller", "live_topology",
    "start_controller",
]


class ControllerError(RuntimeError):
    """Something went wrong talking to a job's controller; the subclass says what."""


class ControllerGone(ControllerError):
    """The controller actor is dead (or was never started): its job needs a new one."""


class ControllerBusy(ControllerError):
    """The controller did not answer in time or cannot be reached for now; ask again later."""


class ControllerFailed(ControllerError):
    """The call reached the controller and raised there."""


class ControllerStartError(ControllerError):
    """Ray could not create the job's controller actor."""


class ClusterUnavailable(RuntimeError):
    """The Ray cluster could not be read."""


def _translate(job_id: str, what: str, e: RayError) -> ControllerError:
    """Ray's error for a call on a controller -> Lattice's (the order matters: subclasses first)."""
    if isinstance(e, GetTimeoutError):
        return ControllerBusy(f"job {job_id}: controller {what} timed out")
    if isinstance(e, ActorUnavailableError):
        return ControllerBusy(f"job {job_id}: controller unavailable: {e}")
    if isinstance(e, RayActorError):
        return ControllerGone(f"{type(e).__name__}: {str(e)[:300]}")
    return ControllerFailed(str(e))


class ControllerClient:
    """One job's controller, as the service sees it."""

    def __init__(self, job_id: str, handle: Any) -> None:
        self.job_id = job_id
        self._handle = handle

    @property
    def name(self) -> str:
        """The controller actor's registered name."""
        return controller_name(self.job_id)

    def poll(self, since_seq: int, timeout_s: float) -> dict[str, Any]:
        """The controller's snapshot (state, events after `since_seq`, progress, placement, result)."""
        try:
            return ray.get(self._handle.poll.remote(since_seq), timeout=timeout_s)
        except RayError as e:
            raise _translate(self.job_id, "poll", e) from e

    def responds(self, since_seq: int, timeout_s: float) -> bool:
        """True if the controller answers a poll; False if it is gone or does not answer in time."""
        try:
            self.poll(since_seq, timeout_s)
        except (ControllerGone, ControllerBusy) as e:
            log.warning("controller did not answer: %s", e)
            return False
        return True

    def cancel(self, reason: str) -> None:
        """Ask the controller to tear down the ranks and the placement group (does not wait)."""
        try:
            self._handle.cancel.remote(reason)
        except RayActorError as e:
            raise ControllerGone(f"job {self.job_id}: controller gone while cancelling") from e

    def preempt(self, reason: str, grace_s: float, timeout_s: float) -> bool:
        """Send a preemption notice: the ranks checkpoint at the next step boundary and stop, and the
        controller ends PREEMPTED (workers.controller.preempt). False if it already had one or is ending."""
        try:
            return bool(ray.get(self._handle.preempt.remote(reason, grace_s), timeout=timeout_s))
        except RayError as e:
            raise _translate(self.job_id, "preempt", e) from e

    def update_nodes(self, health: Mapping[str, str], cordoned: Collection[str]) -> None:
        """Push the service's node ledger (does not wait)."""
        try:
            self._handle.update_nodes.remote(dict(health), sorted(cordoned))
        except RayActorError as e:
            raise ControllerGone(f"job {self.job_id}: controller gone") from e

    def inject_fault(self, fault: Mapping[str, Any], timeout_s: float) -> None:
        """Hand a fault (a workers.faults spec) to the controller and wait until it is armed."""
        try:
            ray.get(self._handle.inject_fault.remote(**dict(fault)), timeout=timeout_s)
        except RayError as e:
            raise _translate(self.job_id, "inject_fault", e) from e


def is_connected() -> bool:
    """True if this process is a driver of a Ray cluster."""
    return bool(ray.is_initialized())


def start_controller(
    job_id: str,
    run_cfg: RunConfig,
    *,
    options: ControllerOptions | None = None,
    failure_policy: FailurePolicy | None = None,
    scaling_policy: ScalingPolicy | None = None,
    health: Mapping[str, str] | None = None,
    cordoned: Collection[str] = (),
) -> ControllerClient:
    """Create the job's detached controller. Raises ControllerExists if one is already registered
    under the job's name, ControllerStartError if Ray refuses to create it."""
    try:
        handle = _start_actor(job_id, run_cfg, options=options, failure_policy=failure_policy,
                              scaling_policy=scaling_policy, health=health, cordoned=cordoned)
    except RayError as e:
        raise ControllerStartError(f"{type(e).__name__}: {e}") from e
    return ControllerClient(job_id, handle)


def find_controller(job_id: str) -> ControllerClient | None:
    """The job's live controller (e.g. after the service restarted), else None."""
    handle = get_controller(job_id)
    return None if handle is None else ControllerClient(job_id, handle)


def kill_controller(job_id: str) -> bool:
    """End the job's controller actor, with its rank actors and placement group; False if there
    was none. A controller that dies on its own meanwhile is fine."""
    handle = get_controller(job_id)
    if handle is None:
        return False
    try:
        ray.kill(handle, no_restart=True)
    except (RayError, ValueError) as e:
        log.debug("kill controller %s: %s", job_id, e)
    return True


def controller_job_ids() -> list[str]:
    """The job ids of every controller registered in the cluster (live or finishing)."""
    prefix = controller_name("")
    try:
        actors = ray.util.list_named_actors(all_namespaces=True)
    except Exception as e:
        raise ClusterUnavailable(f"cannot list named actors: {e}") from e
    return [entry["name"][len(prefix):] for entry in actors
            if entry.get("namespace") == NAMESPACE and entry.get("name", "").startswith(prefix)]


def live_topology() -> Topology:
    """The cluster's racks, nodes and free GPUs as Ray sees them now (health: alive or dead)."""
    try:
        return Topology.from_ray()
    except RayError as e:
        raise ClusterUnavailable(f"cannot read the Ray cluster: {e}") from e
