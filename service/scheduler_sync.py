"""What the scheduler writes into the store, as plain functions over a session (no threads, no Ray
calls): controller events -> job events, checkpoint rows and node faults; the live topology ->
the nodes table; the nodes table -> the health ledger placement reads; controller job states ->
legal store transitions; pending jobs planned for another GPU type -> a plan for the live one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from service import store
from service.schemas import JobSpec
from service.settings import Settings
from service.store.jobs import LEGAL_TRANSITIONS
from service.store.models import Job, JobState, Node, NodeHealth
from workers.topology import Topology

log = logging.getLogger(__name__)

# Event types that count as an attempt (Job.attempt): a controller's restart after a fault, and
# the recovery of a lost controller by the reconciler.
ATTEMPT_EVENTS = ("restart", "recover")
MAX_LOSSES_IN_RESULT = 1000


# ---- job states -------------------------------------------------------------------------------------
def job_transition_path(current: JobState, target: JobState) -> list[JobState]:
    """The legal store transitions that take a job from `current` to the controller's `target`.

    The controller reports `starting` while it places and starts ranks; the store's `starting`
    is set by the scheduler when it launches the controller, so `starting` from the controller
    never moves a job back: a queued job (its controller retrying placement) stays queued, a
    recovering one stays recovering, and a running one (whose restart fell between two polls)
    becomes recovering. Otherwise the shortest legal path (queued -> starting -> running; a job
    that finished between two polls: starting -> running -> succeeded)."""
    if current == target or current.terminal:
        return []
    if target == JobState.STARTING:
        return [JobState.RECOVERING] if current == JobState.RUNNING else []
    seen = {current}
    queue: deque[tuple[JobState, list[JobState]]] = deque([(current, [])])
    while queue:
        state, path = queue.popleft()
        for nxt in sorted(LEGAL_TRANSITIONS[state], key=lambda s: s.value):
            if nxt in seen or (nxt.terminal and nxt != target):
                continue
            if nxt == target:
                return [*path, nxt]
            seen.add(nxt)
            queue.append((nxt, [*path, nxt]))
    raise AssertionError(f"no legal path from {current} to {target}")


# ---- controller events -----------------------------------------------------------------------------
def store_controller_event(s: Session, job: Job, event: Mapping[str, Any]) -> None:
    """Append one controller event to the job's log, with its side effects (checkpoint rows, node
    faults). A committed checkpoint is stored as the checkpoint row and its `checkpoint` event."""
    kind = str(event["kind"])
    payload = {k: v for k, v in event.items() if k not in ("seq", "kind")}
    payload["cseq"] = event["seq"]
    if kind == "checkpoint_saved":
        step = int(event["step"])
        verified = event.get("verified")
        if not isinstance(verified, bool):
            # The engine checks integrity before a step's save and stops instead of saving when it fails.
            every = int(((job.spec or {}).get("fault_tolerance") or {}).get("sdc_check_every", 0) or 0)
            verified = bool(every) and step % every == 0
        store.record_checkpoint(s, job.id, step, str(event.get("path") or ""), verified=verified,
                                bytes=int(event.get("bytes") or 0))
        return
    if kind == "checkpoint_verified" and isinstance(event.get("verified"), bool):
        _mark_checkpoint(s, job.id, int(event["step"]), event["verified"])
    elif kind == "failure" and (event.get("failure") or {}).get("kind") == "checkpoint":
        step = (event.get("failure") or {}).get("step")
        if isinstance(step, int):
            _mark_checkpoint(s, job.id, step, False)  # a damaged checkpoint is never restored
    elif kind == "replanned" and isinstance(event.get("new_layout"), dict) and job.plan:
        # The controller re-planned for the capacity left; a later recovery must use the new layout.
        plan = {**job.plan, "layout": event["new_layout"], "replanned_from": event.get("old_layout")}
        store.set_plan(s, job.id, plan, reason=str(event.get("message") or "replanned by the controller"))
        s.refresh(job)
    elif kind in ("node_suspect", "node_quarantined") and event.get("node"):
        _record_node_fault(s, str(event["node"]), quarantine=kind == "node_quarantined",
                           fault=f"job {job.id}: {event.get('message', kind)}")
    store.append_event(s, job.id, "controller_state" if kind == "state" else kind[:32], payload)


def _mark_checkpoint(s: Session, job_id: str, step: int, verified: bool) -> None:
    if any(c.step == step for c in store.list_checkpoints(s, job_id)):
        store.mark_checkpoint_verified(s, job_id, step, verified)


def _record_node_fault(s: Session, name: str, *, quarantine: bool, fault: str) -> None:
    row = s.get(Node, name)
    if row is None:
        row = store.upsert_node(s, name)
    if quarantine:
        store.set_node_health(s, name, NodeHealth.QUARANTINED)
    elif row.health == NodeHealth.READY.value:
        store.set_node_health(s, name, NodeHealth.SUSPECT, fault=fault)
    else:  # keep a stronger state (quarantined, cordoned, dead); count the fault
        store.set_node_health(s, name, row.health, fault=fault)


def summarize_result(result: Mapping[str, Any], progress: Mapping[str, Any]) -> dict[str, Any]:
    """The job row's `result`: the digest, the losses of the last attempt, the final checkpoint."""
    losses = [x for x in result.get("losses") or [] if isinstance(x, int | float)]
    resumed = result.get("resumed_from")
    checkpoints = list(result.get("checkpoints") or [])
    out: dict[str, Any] = {
        "model_digest": result.get("model_digest"),
        "final_step": result.get("final_step"),
        "resumed_from": resumed,
        "restarts": result.get("restarts", 0),
        "layout": result.get("layout"),
        "loss_first": losses[0] if losses else None,
        "loss_first_step": (resumed or 0) + 1 if losses else None,
        "loss_last": losses[-1] if losses else None,
        "tokens_per_s": progress.get("tokens_per_s"),
        "step_time_s": progress.get("step_time_s"),
        "checkpoint": checkpoints[-1] if checkpoints else None,
    }
    if len(losses) <= MAX_LOSSES_IN_RESULT:
        out["losses"] = losses
    return out


# ---- nodes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterLedger:
    """The store's view of the nodes, keyed by node name: health in Topology's terms (ready,
    suspect, quarantined, dead), the cordoned set, fault counts."""

    health: dict[str, str] = field(default_factory=dict)
    cordoned: frozenset[str] = frozenset()
    faults: dict[str, int] = field(default_factory=dict)


def read_ledger(s: Session) -> ClusterLedger:
    health: dict[str, str] = {}
    cordoned: set[str] = set()
    faults: dict[str, int] = {}
    for row in store.list_nodes(s):
        faults[row.id] = row.fault_count
        if row.health == NodeHealth.CORDONED.value:
            cordoned.add(row.id)
            health[row.id] = uncordoned_health(row)
        else:
            health[row.id] = row.health
    return ClusterLedger(health, frozenset(cordoned), faults)


def uncordoned_health(row: Node) -> str:
    """The health a cordoned node has underneath (and returns to when uncordoned)."""
    return NodeHealth.SUSPECT.value if row.fault_count else NodeHealth.READY.value


# States that a node's death or return does not overwrite: an operator's or the fault ledger's call.
_STICKY = {NodeHealth.QUARANTINED.value, NodeHealth.CORDONED.value}


def sync_nodes(s: Session, live: Topology, *, dry_run: bool = False) -> list[str]:
    """Make the nodes table match the live cluster (GPU nodes, keyed by node name): new nodes are
    added ready, missing or dead ones become dead, a dead node that is back becomes ready (suspect
    if it has faults). Returns what changed (or would change, with dry_run)."""
    rows = {r.id: r for r in store.list_nodes(s)}
    changes: list[str] = []
    seen: set[str] = set()
    for n in live.nodes:
        if n.gpus_total == 0 or n.is_head:
            continue
        seen.add(n.name)
        row = rows.get(n.name)
        health: str | None = None
        if row is None:
            health = NodeHealth.READY.value if n.alive else NodeHealth.DEAD.value
        elif not n.alive and row.health not in _STICKY | {NodeHealth.DEAD.value}:
            health = NodeHealth.DEAD.value
        elif n.alive and row.health == NodeHealth.DEAD.value:
            health = uncordoned_health(row)
        inventory = (n.hostname, n.rack, n.gpus_total)
        if row is not None and health is None and inventory == (row.hostname, row.rack, row.gpus):
            continue
        changes.append(f"{n.name}: {'new' if row is None else row.health} -> {health or row.health}")
        if not dry_run:
            store.upsert_node(s, n.name, hostname=n.hostname, rack=n.rack, gpus=n.gpus_total, health=health)
    for name, row in rows.items():
        if name not in seen and row.health not in _STICKY | {NodeHealth.DEAD.value}:
            changes.append(f"{name}: {row.health} -> dead (gone from the cluster)")
            if not dry_run:
                store.set_node_health(s, name, NodeHealth.DEAD)
    if changes and not dry_run:
        log.info("nodes table: %s", "; ".join(changes))
    return changes


# ---- plans ----------------------------------------------------------------------------------------
def _canonical_gpu(name: str | None) -> str | None:
    from service.planner import PlannerError, get_gpu

    if not name:
        return None
    try:
        return get_gpu(name).name
    except PlannerError:
        return name


def replan_if_needed(s: Session, job: Job, settings: Settings, topology: Topology) -> str | None:
    """Re-plan a job whose plan is for another GPU type than the live cluster's (settings.gpu_type)
    or that has no plan; returns an error message when no plan fits the live cluster."""
    from service.planner import ClusterSpec, PlannerError, TrainSpec, evaluate, plan

    current = job.plan or {}
    planned = _canonical_gpu((current.get("cluster") or {}).get("gpu_type"))
    live = _canonical_gpu(settings.gpu_type)
    if current.get("layout") and planned == live:
        return None
    try:
        spec = JobSpec.model_validate(job.spec)
        model = spec.model_spec()
        layout = spec.explicit_layout()
        alive = [n for n in topology.gpu_nodes if n.alive]
        total = sum(n.gpus_total for n in alive)
        racks = topology.racks
        per_rack = max((len(ns) for ns in racks.values()), default=1)
        num_gpus = spec.resources.gpus or (layout.world_size if layout else total)
        cluster = ClusterSpec(
            gpu_type=settings.gpu_type, num_gpus=max(1, num_gpus),
            gpus_per_node=topology.gpus_per_node() or settings.embedded_gpus_per_node,
            nodes_per_rack=max(1, per_rack),
        )
        train = TrainSpec(global_batch=spec.train.global_batch, seq_len=model.seq_len,
                          precision=spec.train.precision)
        new = plan(model, train, cluster) if layout is None else evaluate(model, train, cluster, layout)
    except (PlannerError, ValueError) as e:
        return f"no feasible plan for the live cluster ({settings.gpu_type}): {e}"
    reason = f"re-planned for the live cluster's {live} (the plan was for {planned or 'nothing'})"
    store.set_plan(s, job.id, new.to_dict(), reason=reason)
    return None
