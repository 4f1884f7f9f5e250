"""/v1/cluster: racks, nodes, GPUs total/free and health; admin cordon/uncordon/drain of a node.

The live view comes from the scheduler (its last tick's topology of the Ray cluster, merged with
the store's health ledger), so a request never calls Ray. Without a scheduler (an API-only
process) the nodes table is shown, without free-GPU counts.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from service import store
from service.api.deps import AdminPrincipal, CurrentPrincipal, ReadSessionDep, SessionDep, SettingsDep
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.errors import Conflict, NotFound
from service.store.leases import read_lease
from service.store.models import Node, NodeHealth
from service.store.nodes import ClusterLedger, uncordoned_health
from service.store.profiles import profile_summaries
from workers.topology import NodeInfo, Topology

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], route_class=ModelResponseRoute)

NodeId = Annotated[
    str,
    Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$", description="Node name (e.g. r1-n2) or Ray node id.",
         examples=["r1-n2"]),
]


class ClusterSource(Protocol):
    def cluster_view(self) -> tuple[Topology | None, ClusterLedger | None]: ...


class NodePublic(BaseModel):
    id: str = Field(description="Node name: the `node_name` label, stable across restarts of the node.")
    ray_node_id: str | None = Field(description="Ray's id of the node's current raylet (null: not live).")
    rack: str
    hostname: str
    gpus_total: int
    gpus_free: int | None = Field(description="Free GPUs now (null without a live view).")
    alive: bool
    health: Literal["ready", "suspect", "quarantined", "dead"]
    cordoned: bool = Field(description="An admin cordoned it: it keeps its health but gets no new ranks.")
    schedulable: bool = Field(description="May receive new ranks: alive, ready or suspect, not cordoned.")
    fault_count: int
    last_fault: str | None = Field(
        description="The latest fault counted against the node (admin tokens only: it can name other "
        "tenants' jobs; null for user tokens)."
    )


class RackPublic(BaseModel):
    name: str
    nodes: list[str]
    gpus_total: int
    gpus_free: int | None


class SchedulerPublic(BaseModel):
    leader: str | None = Field(
        description="The acting scheduler process as 'host:pid' (null: none holds a running lease)."
    )
    since: dt.datetime | None = Field(description="When the current leader's term began.")
    term: int = Field(description="The leader's term: +1 on every change of leader (0: never elected).")


class SparePublic(BaseModel):
    job: str | None = Field(description="The job the spare is kept for (admin tokens only; null for user "
                            "tokens: it can name other tenants' jobs).")
    node: str
    rack: str | None = None
    state: Literal["starting", "warm"] = Field(description="starting: imports under way; warm: ready.")
    age_s: float = Field(description="Seconds since the spare was started.")


class ClusterPublic(BaseModel):
    source: Literal["live", "store"] = Field(
        description="live: the scheduler's view of the Ray cluster; store: the nodes table only."
    )
    gpu_type: str = Field(description="The GPU type the planner assumes for this cluster.")
    racks: list[RackPublic]
    nodes: list[NodePublic]
    gpus_total: int
    gpus_free: int | None
    gpus_schedulable: int | None
    links: dict[str, float] | None = Field(description="Bandwidth per GPU of each tier, GB/s.")
    scheduler: SchedulerPublic = Field(description="The elected scheduler, from its lease in the store.")
    spares: list[SparePublic] = Field(
        default_factory=list,
        description="Hot spare rank actors kept beside running jobs (`fault_tolerance.spares`): each holds a "
        "GPU outside its job's placement and does not count against quotas (docs/fault_tolerance.md).",
    )
    profiles: list[dict[str, Any]] = Field(
        default_factory=list,
        description="The newest measured hardware profile of each node type (`lattice calibrate`): "
        "node_type, version, created_at, matmul_tflops per dtype, memory_gbps, all_reduce {gbps, "
        "latency_us} within a node, inter_node_all_reduce between two nodes (when measured) and, on CPU "
        "node types, oversubscription {workload: [[processes per core, slowdown]]}. "
        "Plans on a cluster of that node type use it.",
    )


def _live(request: Request) -> tuple[Topology | None, ClusterLedger | None]:
    source: Any = getattr(request.app.state, "scheduler", None)
    view = getattr(source, "cluster_view", None)
    return view() if callable(view) else (None, None)


def _node_from_row(row: Node, live: NodeInfo | None, *, admin: bool = True) -> NodePublic:
    cordoned = row.health == NodeHealth.CORDONED.value
    health = uncordoned_health(row) if cordoned else row.health
    if live is not None and not live.alive:
        health = health if health == NodeHealth.QUARANTINED.value else NodeHealth.DEAD.value
    alive = live.alive if live is not None else health != NodeHealth.DEAD.value
    schedulable = alive and health in ("ready", "suspect") and not cordoned and row.gpus > 0
    return NodePublic(
        id=row.id, ray_node_id=live.node_id if live is not None else None, rack=row.rack,
        hostname=row.hostname, gpus_total=row.gpus,
        gpus_free=(live.gpus_free if live.alive else 0) if live is not None else None,
        alive=alive, health=health, cordoned=cordoned,  # type: ignore[arg-type]
        schedulable=schedulable, fault_count=row.fault_count, last_fault=row.last_fault if admin else None,
    )


def _live_by_name(topology: Topology | None) -> dict[str, NodeInfo]:
    return {n.name: n for n in topology.gpu_nodes} if topology is not None else {}


@router.get("", response_model=ClusterPublic, summary="Racks, nodes, GPUs and health",
            responses=problem_responses(401))
def get_cluster(
    request: Request, session: ReadSessionDep, principal: CurrentPrincipal, settings: SettingsDep
) -> ClusterPublic:
    topology, _ = _live(request)
    live = _live_by_name(topology)
    rows = store.list_nodes(session)
    nodes = [_node_from_row(r, live.get(r.id), admin=principal.is_admin) for r in rows]
    racks: dict[str, list[NodePublic]] = {}
    for n in nodes:
        racks.setdefault(n.rack, []).append(n)
    has_live = topology is not None

    def free(ns: list[NodePublic]) -> int | None:
        return sum(n.gpus_free or 0 for n in ns if n.alive) if has_live else None

    return ClusterPublic(
        source="live" if has_live else "store",
        gpu_type=settings.gpu_type,
        racks=[
            RackPublic(name=rack, nodes=[n.id for n in ns],
                       gpus_total=sum(n.gpus_total for n in ns if n.alive), gpus_free=free(ns))
            for rack, ns in sorted(racks.items())
        ],
        nodes=nodes,
        gpus_total=sum(n.gpus_total for n in nodes if n.alive),
        gpus_free=free(nodes),
        gpus_schedulable=sum(n.gpus_free or 0 for n in nodes if n.schedulable) if has_live else None,
        links=dict(topology.to_dict()["links"]) if topology is not None else None,
        scheduler=_scheduler(session),
        spares=_spares(request, admin=principal.is_admin),
        profiles=profile_summaries(session),
    )


def _spares(request: Request, *, admin: bool) -> list[SparePublic]:
    source: Any = getattr(request.app.state, "scheduler", None)
    view = getattr(source, "spares_view", None)
    rows = view() if callable(view) else []
    return [SparePublic.model_validate({**{k: s.get(k) for k in SparePublic.model_fields},
                                        "job": s.get("job") if admin else None}) for s in rows]


def _scheduler(session: Session) -> SchedulerPublic:
    lease = read_lease(session)
    if lease is None:
        return SchedulerPublic(leader=None, since=None, term=0)
    leader = lease.current_holder()
    return SchedulerPublic(leader=leader, since=lease.since if leader else None, term=lease.term)


def _find_row(session: Session, request: Request, node_id: str) -> Node:
    row = session.get(Node, node_id)
    if row is None:  # a Ray node id: find its name in the live view
        topology, _ = _live(request)
        name = next((n.name for n in (topology.nodes if topology else ()) if n.node_id == node_id), None)
        row = session.get(Node, name) if name is not None else None
    if row is None:
        known = ", ".join(r.id for r in store.list_nodes(session)) or "none yet"
        raise NotFound(f"node {node_id!r} not found; known nodes: {known}")
    return row


def _set_cordon(request: Request, session: Session, node_id: str, cordon: bool,
                drain: str | None = None) -> NodePublic:
    """Cordon (and with `drain`, record why the node drains: the leading scheduler, wherever it runs,
    reads it and notifies the node's jobs) or uncordon, which ends a drain."""
    row = _find_row(session, request, node_id)
    health = row.health
    if cordon:
        if health in (NodeHealth.QUARANTINED.value, NodeHealth.DEAD.value):
            raise Conflict(f"node {row.id!r} is {health}: it already receives no ranks")
        if health != NodeHealth.CORDONED.value:
            store.set_node_health(session, row.id, NodeHealth.CORDONED)
        if drain is not None:
            row.drain_reason = drain
    else:
        row.drain_reason = None
        if health == NodeHealth.DEAD.value:
            raise Conflict(f"node {row.id!r} is dead; it becomes ready when it rejoins the cluster")
        if health in (NodeHealth.CORDONED.value, NodeHealth.QUARANTINED.value):
            # Uncordoning a quarantined node is the operator's "repaired, back in service".
            back = uncordoned_health(row) if health == NodeHealth.CORDONED.value else NodeHealth.READY.value
            store.set_node_health(session, row.id, back)
    session.commit()
    session.refresh(row)
    scheduler: Any = getattr(request.app.state, "scheduler", None)
    if scheduler is not None:
        scheduler.wake()
    return _node_from_row(row, _live_by_name(_live(request)[0]).get(row.id))


@router.post("/nodes/{node_id}/cordon", response_model=NodePublic, summary="Cordon a node (admin)",
             description="The node keeps running what it has but receives no new ranks.",
             responses=problem_responses(401, 403, 404, 409, 422))
def cordon_node(node_id: NodeId, request: Request, session: SessionDep, admin: AdminPrincipal) -> NodePublic:
    return _set_cordon(request, session, node_id, True)


@router.post("/nodes/{node_id}/drain", response_model=NodePublic, summary="Drain a node (admin)",
             description="Cordon the node and send a preemption notice to every job with ranks on it: each "
             "checkpoints at its next step boundary, goes back to the queue and resumes elsewhere from that "
             "step (jobs with preemption.preemptible false are left alone). The node takes no new ranks "
             "until uncordoned.",
             responses=problem_responses(401, 403, 404, 409, 422))
def drain_node(node_id: NodeId, request: Request, session: SessionDep, admin: AdminPrincipal) -> NodePublic:
    why = f"drained by an admin of tenant {admin.tenant}"
    node = _set_cordon(request, session, node_id, True, drain=why)
    scheduler: Any = getattr(request.app.state, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "drain"):  # in-process: act now, not next tick
        scheduler.drain(node.id, why)
    return node


@router.post("/nodes/{node_id}/uncordon", response_model=NodePublic, summary="Uncordon a node (admin)",
             description="A cordoned (or quarantined, after repair) node receives ranks again.",
             responses=problem_responses(401, 403, 404, 409, 422))
def uncordon_node(
    node_id: NodeId, request: Request, session: SessionDep, admin: AdminPrincipal
) -> NodePublic:
    return _set_cordon(request, session, node_id, False)


__all__ = ["ClusterPublic", "NodePublic", "RackPublic", "SchedulerPublic", "SparePublic", "router"]
