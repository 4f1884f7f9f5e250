"""The live cluster -> the nodes table, and the capacity the queue may use: new nodes are added,
missing ones marked dead, and each node's free GPUs lowered by what attached jobs hold."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from sqlalchemy.orm import Session

from service import store
from service.store.models import NodeHealth
from service.store.nodes import uncordoned_health
from workers.topology import Topology

log = logging.getLogger(__name__)

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


def free_view(topology: Topology, held: Mapping[str, int]) -> Topology:
    """The topology with each node's free GPUs lowered by what attached jobs hold or are about to
    reserve (`held`: node name -> GPUs; Ray's free counts lag a placement group not created yet)."""
    nodes = tuple(
        dataclasses.replace(n, gpus_free=max(0, min(n.gpus_free, n.gpus_total - held.get(n.name, 0))))
        for n in topology.nodes
    )
    return dataclasses.replace(topology, nodes=nodes)
