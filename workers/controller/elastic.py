"""Growing back (`fault_tolerance.elastic`): a job that a replan shrank runs below its planned size;
when capacity returns (a node uncordoned or back, a new node) it is replanned up at the next step
boundary, the global batch kept, and continues from the checkpoint it took there.

The service gives an elastic job an `ElasticPolicy`: a `ReplanPolicy` whose replanner never goes
below `min_gpus` (`MinGpusReplanner`), plus the bound `max_gpus` for growing back (the originally
planned world size unless the spec says more). The state machine calls `on_poll` from RUNNING /
CHECKPOINTING, after the preemption hook: every `grow_check_s` and at every checkpoint boundary (so
within one checkpoint interval of the capacity's return) it reads the topology and, when a
larger layout fits (`grow_layout`, pure), asks the ranks to checkpoint and stop; once they stopped
short of the last step it replans up (a `replanned` event with the plan diff and `grew: true`) and
goes to PLACING. The ranks restore that checkpoint resharded (DCP by FQN handles the new DP).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from training.config.layout import Layout
from workers.controller.attempt import Attempt
from workers.controller.state import ControllerState, Transition
from workers.events import EventKind
from workers.placement import PlacementError, place
from workers.policies import ReplanPolicy, ScalingPolicy, keep_global_batch_replanner
from workers.topology import Topology
from workers.worker_group import GroupStatus

if TYPE_CHECKING:
    from workers.controller.machine import ControllerStateMachine

log = logging.getLogger(__name__)

DEFAULT_GROW_CHECK_S = 5.0


@dataclass(frozen=True)
class MinGpusReplanner:
    """The fallback planner (`keep_global_batch_replanner`: a smaller DP, the global batch kept), but
    never below `min_gpus`: then there is no layout and the job waits for capacity."""

    min_gpus: int = 1

    def __call__(self, topology: Topology, layout: Layout) -> Layout | None:
        new = keep_global_batch_replanner(topology, layout)
        return None if new is None or new.world_size < self.min_gpus else new


@dataclass
class ElasticPolicy(ReplanPolicy):
    """Shrink when capacity is short (ReplanPolicy) and grow back when it returns, up to `max_gpus`
    (None: the world size the controller started with)."""

    min_gpus: int = 1
    max_gpus: int | None = None
    grow_check_s: float = DEFAULT_GROW_CHECK_S  # how often a job below its size reads the topology


def elastic_policy(min_gpus: int | None, max_gpus: int | None,
                   grow_check_s: float = DEFAULT_GROW_CHECK_S) -> ElasticPolicy:
    """The scaling policy of an elastic job (what the service passes to the controller)."""
    floor = max(1, min_gpus or 1)
    return ElasticPolicy(replanner=MinGpusReplanner(floor), min_gpus=floor, max_gpus=max_gpus,
                         grow_check_s=grow_check_s)


@dataclass
class Growth:
    """An elastic job's growing-back state, owned by the state machine."""

    policy: ElasticPolicy
    planned: Layout  # the layout the controller started with
    next_check: float = 0.0  # on the controller's monotonic clock
    target: Layout | None = None  # the layout to grow to, once checkpoint-and-stop was asked
    asked_in: Attempt | None = None  # the attempt that was asked (a restart cancels the request)
    checked_at_ckpt: int | None = None  # the last checkpoint step at which capacity was looked for

    @property
    def max_gpus(self) -> int:
        return self.policy.max_gpus or self.planned.world_size


def setup(policy: ScalingPolicy, layout: Layout) -> Growth | None:
    """A Growth for an elastic job's controller; None for any other scaling policy."""
    return Growth(policy, layout) if isinstance(policy, ElasticPolicy) else None


def own_gpus(placement: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Node name -> GPUs this job's ranks hold there (freed when it stops to grow)."""
    held: dict[str, int] = {}
    for r in placement:
        name = str(r.get("node_name") or r.get("node_id"))
        held[name] = held.get(name, 0) + 1
    return held


def grow_layout(current: Layout, topology: Topology, held: Mapping[str, int], max_gpus: int,
                exclude: Collection[str] = (), planned: Layout | None = None) -> Layout | None:
    """The largest DP above `current.dp` whose world size is at most `max_gpus`, whose global batch is
    `current`'s (dp x micro_batch_size x num_microbatches; accumulation lowered to keep it) and which
    places on `topology` with the GPUs `held` by the job itself counted free; None if there is none.
    A `planned` HSDP layout's shard groups come back with the replicas (Layout.with_dp)."""
    shard = planned.dp_shard if planned is not None and planned.dp_replicate > 1 else None
    freed = _with_freed(topology, held)
    per_replica = current.world_size // current.dp
    batch = current.global_batch
    for dp in range(max_gpus // per_replica, current.dp, -1):
        if batch % (dp * current.micro_batch_size):
            continue
        try:
            candidate = current.with_dp(dp, batch // (dp * current.micro_batch_size), shard)
            place(candidate, freed, exclude_nodes=exclude)
        except (ValueError, PlacementError):  # LayoutError is a ValueError
            continue
        return candidate
    return None


def _with_freed(topology: Topology, held: Mapping[str, int]) -> Topology:
    nodes = []
    for n in topology.nodes:
        back = held.get(n.name, held.get(n.node_id, 0))
        nodes.append(dataclasses.replace(n, gpus_free=min(n.gpus_total, n.gpus_free + back)) if back else n)
    return dataclasses.replace(topology, nodes=tuple(nodes))


def on_poll(sm: ControllerStateMachine, status: GroupStatus, now: float) -> Transition | None:
    """While training below the bound: look for capacity every `grow_check_s`; when a larger layout
    fits, ask for checkpoint-and-stop; once every rank stopped short of the last step, replan up."""
    growth = sm.growth
    assert growth is not None
    if growth.target is not None and growth.asked_in is not sm.attempt:
        growth.target = growth.asked_in = None  # the ranks restarted since: the request is void
    if growth.target is None:
        _maybe_ask(sm, growth, status, now)
        return None
    if not status.all_finished:
        return None
    final = _final_step(status)
    if final is None or final >= sm.run_cfg.steps:
        growth.target = growth.asked_in = None
        return None  # it finished before the request took effect: the normal finish
    return _grow(sm, growth, final)


def _maybe_ask(sm: ControllerStateMachine, growth: Growth, status: GroupStatus, now: float) -> None:
    current = sm.run_cfg.layout
    busy = sm.attempt.ckpt_open is not None or sm.preemption is not None or sm.cancel_requested
    # Every grow_check_s, and at every checkpoint boundary: a job grows back within one checkpoint
    # interval of the capacity's return, however fast its steps are.
    ckpt = sm.job.progress.get("last_checkpoint_step")
    due = now >= growth.next_check or (ckpt is not None and ckpt != growth.checked_at_ckpt)
    if not due or current.world_size >= growth.max_gpus or busy or not sm.attempt.stepped \
            or status.all_finished:
        return  # not now: at its bound, a checkpoint in flight, a notice, or not stepping yet
    growth.next_check, growth.checked_at_ckpt = now + growth.policy.grow_check_s, ckpt
    if (sm.job.progress.get("step") or 0) >= sm.run_cfg.steps - 1:
        return  # the job ends at the next step anyway
    attributor = sm.attributor
    topology = sm.wg.topology(attributor.health_view(), attributor.cordoned)
    target = grow_layout(current, topology, own_gpus(sm.job.placement), growth.max_gpus, attributor.exclude,
                         growth.planned)
    if target is None:
        return
    growth.target, growth.asked_in = target, sm.attempt
    log.info("job %s: capacity for %s; checkpointing at the next step to grow", sm.job_id, target.describe())
    sm.wg.request_action("checkpoint_and_stop")


def _final_step(status: GroupStatus) -> int | None:
    steps = [r.result.get("final_step") for r in status.ranks.values() if isinstance(r.result, dict)]
    steps = [s for s in steps if isinstance(s, int)]
    return min(steps) if steps else None


def _grow(sm: ControllerStateMachine, growth: Growth, final: int) -> Transition:
    """The ranks stopped at the checkpoint of step `final`: replan up and place the grown layout."""
    old, new = sm.run_cfg.layout, growth.target
    assert new is not None
    growth.target = growth.asked_in = None
    sm.wg.shutdown()
    sm.scrubber.scrub_on_disk(sm.run_cfg.checkpoint.dir)
    restore = sm.scrubber.expected_restore()
    sm.run_cfg = dataclasses.replace(sm.run_cfg, layout=new)
    sm.recovery.resume = True
    after = new.to_dict()
    diff = {k: [v, after[k]] for k, v in old.to_dict().items() if after.get(k) != v}
    sm.log.emit(EventKind.REPLANNED, f"capacity returned: grew from {old.world_size} to {new.world_size} "
                f"GPUs at the checkpoint of step {final}", old=old.describe(), new=new.describe(),
                old_layout=old.to_dict(), new_layout=after, diff=diff, grew=True, step=final,
                restore_step=restore, global_batch_kept=old.global_batch == new.global_batch)
    return sm._to(ControllerState.PLACING, "placing the grown layout")  # noqa: SLF001 - the machine's helper
