"""Cluster nodes as the service sees them: rack, GPUs and health (ready/suspect/quarantined/cordoned/dead)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.store.models import Node, NodeHealth, utcnow

# A node is quarantined on faults (not a confirmed hardware signal) only when this many different
# jobs had faults on it: one job's own faults never quarantine a node.
QUARANTINE_AFTER_JOBS = 2


def parse_health(value: str | NodeHealth) -> NodeHealth:
    try:
        return NodeHealth(value)
    except ValueError as e:
        allowed = ", ".join(h.value for h in NodeHealth)
        raise ValueError(f"health must be one of {allowed}, got {value!r}") from e


def upsert_node(
    session: Session,
    node_id: str,
    *,
    hostname: str = "",
    rack: str = "",
    gpus: int = 0,
    health: str | NodeHealth | None = None,
) -> Node:
    """Insert or refresh a node's inventory; `health` None keeps the stored health (ready if new)."""
    node = session.get(Node, node_id)
    if node is None:
        node = Node(id=node_id, health=NodeHealth.READY.value, fault_count=0)
        session.add(node)
    node.hostname = hostname
    node.rack = rack
    node.gpus = gpus
    if health is not None:
        node.health = parse_health(health).value
    node.updated_at = utcnow()
    session.flush()
    return node


def set_node_health(
    session: Session, node_id: str, health: str | NodeHealth, *, fault: str | None = None
) -> Node:
    """Set a node's health; a `fault` description also counts a fault against the node."""
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id!r} not found")
    now = utcnow()
    node.health = parse_health(health).value
    if node.health == NodeHealth.READY.value and fault is None:
        node.fault_jobs = None  # an operator's "ready" starts the node's fault ledger afresh
    if fault is not None:
        node.fault_count += 1
        node.last_fault = fault
        node.last_fault_at = now
    node.updated_at = now
    session.flush()
    return node


def record_node_fault(
    session: Session, node_id: str, job_id: str, fault: str, *, confirmed: bool = False,
    quarantine_after_jobs: int = QUARANTINE_AFTER_JOBS,
) -> Node:
    """Count a fault of `job_id` on the node (its `fault_jobs` ledger) and set its health: quarantined
    on a `confirmed` hardware signal or once `quarantine_after_jobs` different jobs had faults on it,
    otherwise suspect; a stronger state (quarantined, cordoned, dead) is kept."""
    node = session.get(Node, node_id) or upsert_node(session, node_id)
    jobs = [str(j) for j in (node.fault_jobs or [])]
    if job_id not in jobs:
        node.fault_jobs = [*jobs, job_id]  # a new list: the JSON column sees the change
    many = len(node.fault_jobs or []) >= quarantine_after_jobs
    if confirmed or (many and node.health in (NodeHealth.READY.value, NodeHealth.SUSPECT.value)):
        health = NodeHealth.QUARANTINED.value
        if not confirmed:
            fault = f"{fault} (faults from {len(node.fault_jobs or [])} jobs: quarantined)"
    elif node.health == NodeHealth.READY.value:
        health = NodeHealth.SUSPECT.value
    else:
        health = node.health
    return set_node_health(session, node_id, health, fault=fault)


def get_node(session: Session, node_id: str) -> Node:
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id!r} not found")
    return node


def list_nodes(session: Session, *, health: str | NodeHealth | None = None) -> list[Node]:
    query = select(Node).order_by(Node.rack, Node.id)
    if health is not None:
        query = query.where(Node.health == parse_health(health).value)
    return list(session.scalars(query))


def uncordoned_health(row: Node) -> str:
    """The health a cordoned node has underneath (and returns to when uncordoned)."""
    return NodeHealth.SUSPECT.value if row.fault_count else NodeHealth.READY.value


@dataclass(frozen=True)
class ClusterLedger:
    """The store's view of the nodes, keyed by node name: health in Topology's terms (ready,
    suspect, quarantined, dead), the cordoned set, fault counts."""

    health: dict[str, str] = field(default_factory=dict)
    cordoned: frozenset[str] = frozenset()
    faults: dict[str, int] = field(default_factory=dict)


def read_ledger(session: Session) -> ClusterLedger:
    """The health ledger placement reads, from the nodes table."""
    health: dict[str, str] = {}
    cordoned: set[str] = set()
    faults: dict[str, int] = {}
    for row in list_nodes(session):
        faults[row.id] = row.fault_count
        if row.health == NodeHealth.CORDONED.value:
            cordoned.add(row.id)
            health[row.id] = uncordoned_health(row)
        else:
            health[row.id] = row.health
    return ClusterLedger(health, frozenset(cordoned), faults)
