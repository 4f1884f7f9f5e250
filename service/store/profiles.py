"""Measured hardware profiles per node type, versioned: save a new version, read the newest.

The planner reads them as service.planner.efficiency.HardwareProfile (`newest_profile`); a plan
records the {node_type, version} it used.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.planner.efficiency import HardwareProfile
from service.store.models import HardwareProfileRecord


def save_profile(session: Session, doc: Mapping[str, Any]) -> HardwareProfile:
    """Store `doc` as the next version of its node type's profile; ValueError when malformed.

    The version is one more than the newest stored (unique per node type: two concurrent writers
    collide on the constraint instead of sharing a number). A document without the inter-node tier
    keeps the newest version's: it is timed between two nodes (service/scheduler/autocalibrate.py),
    which `lattice calibrate` on one machine does not do."""
    parsed = HardwareProfile.from_dict(doc)
    previous = newest_profile(session, parsed.node_type)
    version = (previous.version if previous is not None else 0) + 1
    stored = {**parsed.to_dict(), "version": version}
    if not parsed.inter_node and previous is not None and previous.inter_node:
        stored["inter_node"] = previous.to_dict()["inter_node"]
    session.add(HardwareProfileRecord(node_type=parsed.node_type, version=version, profile=stored))
    session.flush()
    return HardwareProfile.from_dict(stored)


def newest_profile(session: Session, node_type: str) -> HardwareProfile | None:
    """The newest profile of `node_type`, or None when it was never calibrated."""
    row = session.scalars(
        select(HardwareProfileRecord)
        .where(HardwareProfileRecord.node_type == node_type)
        .order_by(HardwareProfileRecord.version.desc())
        .limit(1)
    ).first()
    return HardwareProfile.from_dict(row.profile) if row is not None else None


def get_profile(session: Session, node_type: str, version: int) -> HardwareProfile | None:
    row = session.scalars(
        select(HardwareProfileRecord).where(
            HardwareProfileRecord.node_type == node_type, HardwareProfileRecord.version == version
        )
    ).first()
    return HardwareProfile.from_dict(row.profile) if row is not None else None


def newest_profiles(session: Session) -> dict[str, HardwareProfile]:
    """node type -> its newest profile, for every calibrated node type."""
    return {p.node_type: p for p in (HardwareProfile.from_dict(r.profile) for r in _newest_rows(session))}


def _newest_rows(session: Session) -> list[HardwareProfileRecord]:
    latest = (
        select(HardwareProfileRecord.node_type, func.max(HardwareProfileRecord.version).label("v"))
        .group_by(HardwareProfileRecord.node_type)
        .subquery()
    )
    newest = (HardwareProfileRecord.node_type == latest.c.node_type) & (
        HardwareProfileRecord.version == latest.c.v
    )
    query = select(HardwareProfileRecord).join(latest, newest).order_by(HardwareProfileRecord.node_type)
    return list(session.scalars(query).all())


def profile_summaries(session: Session) -> list[dict[str, Any]]:
    """The newest profile of every node type, summarised (`GET /v1/cluster`, `lattice cluster status`)."""
    rows = _newest_rows(session)
    return [summarize(HardwareProfile.from_dict(r.profile), r.created_at.isoformat()) for r in rows]


def summarize(p: HardwareProfile, created_at: str | None = None) -> dict[str, Any]:
    """Headline figures of a profile: best matmul FLOP/s per dtype, memory bandwidth, all-reduce within a
    node and (when two nodes were timed) between nodes, and on CPU node types the oversubscription."""
    from service.planner.efficiency import fit_alpha_beta

    out: dict[str, Any] = {
        "node_type": p.node_type,
        "version": p.version,
        "created_at": created_at,
        "compute_dtype": p.compute_dtype,
        "matmul_tflops": {d: max(pt[3] for pt in pts) / 1e12 for d, pts in p.matmul.items() if pts},
        "memory_gbps": p.memory_bw / 1e9,
        "backend": p.backend,
    }
    for key, coll in (("all_reduce", p.collectives), ("inter_node_all_reduce", p.inter_node)):
        if coll.get("all_reduce"):
            alpha, beta = fit_alpha_beta(coll["all_reduce"])
            out[key] = {"latency_us": alpha * 1e6, "gbps": beta / 1e9}
    if p.oversubscription:  # CPU node types: slowdown over the ideal share at N processes a core
        out["oversubscription"] = {k: [list(pt) for pt in pts] for k, pts in p.oversubscription.items()}
    return out


def profile_for(session: Session, gpu_type: str | None) -> HardwareProfile | None:
    """The newest profile of the node type a plan for `gpu_type` (a catalogue name or alias) runs on;
    None when that type was never calibrated or the name is unknown (the planner then says why)."""
    from training.config.hardware import find_gpu

    gpu = find_gpu(gpu_type) if gpu_type else None
    return newest_profile(session, gpu.name) if gpu is not None else None
