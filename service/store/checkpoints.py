"""Checkpoints a job has written: step, path, whether the manifest was verified, size."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import NotFound
from service.store.jobs import append_event
from service.store.models import Checkpoint


def record_checkpoint(
    session: Session,
    job_id: str,
    step: int,
    path: str,
    *,
    verified: bool = False,
    manifest_digest: str | None = None,
    bytes: int = 0,
) -> Checkpoint:
    """Record (or re-record) the checkpoint of `job_id` at `step` and append a `checkpoint` event."""
    ckpt = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    if ckpt is None:
        ckpt = Checkpoint(job_id=job_id, step=step)
        session.add(ckpt)
    ckpt.path = path
    ckpt.verified = verified
    ckpt.manifest_digest = manifest_digest
    ckpt.bytes = bytes
    session.flush()
    append_event(
        session,
        job_id,
        "checkpoint",
        {
            "step": step,
            "path": path,
            "verified": verified,
            "manifest_digest": manifest_digest,
            "bytes": bytes,
        },
    )
    return ckpt


def mark_checkpoint_verified(session: Session, job_id: str, step: int, verified: bool = True) -> Checkpoint:
    ckpt = session.scalar(select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step))
    if ckpt is None:
        raise NotFound(f"job {job_id!r} has no checkpoint at step {step}")
    ckpt.verified = verified
    session.flush()
    return ckpt


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
    )


def latest_checkpoint(session: Session, job_id: str, *, verified_only: bool = True) -> Checkpoint | None:
    """The newest checkpoint to resume from (only verified ones unless told otherwise)."""
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if verified_only:
        query = query.where(Checkpoint.verified.is_(True))
    return session.scalar(query.order_by(Checkpoint.step.desc()).limit(1))
