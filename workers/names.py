"""Names that the pieces of `workers` (and the service) must agree on: the Ray namespace, the names
of the named actors, the resource that marks the head node, and how to find the head node.

A leaf module: it imports nothing from `workers` (and Ray only inside `head_node_id`).
"""

from __future__ import annotations

NAMESPACE = "lattice"  # the Ray namespace of every named Lattice actor
KILLER_NAME = "lattice-node-killer"  # the cluster owner's mailbox for kill_node faults
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node only


def controller_name(job_id: str) -> str:
    """The name of a job's detached controller actor."""
    return f"lattice-job-{job_id}"


def placement_group_name(job_id: str, attempt: int) -> str:
    """The name of a job's placement group for its `attempt`-th reservation."""
    return f"{controller_name(job_id)}-a{attempt}"


def head_node_id() -> str | None:
    """The id of the live head node, or None (a cluster seen without one)."""
    import ray

    for n in ray.nodes():
        if n.get("Alive") and HEAD_RESOURCE in (n.get("Resources") or {}):
            return str(n["NodeID"])
    return None
