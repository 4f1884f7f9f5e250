"""Cluster nodes as the service sees them: rack, GPUs and health (ready/suspect/quarantined/cordoned/dead)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.store.models import Node, NodeHealth, utcnow


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
    if fault is not None:
        node.fault_count += 1
        node.last_fault = fault
        node.last_fault_at = now
    node.updated_at = now
    session.flush()
    return node


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
