"""A job whose training has diverged: one `loss_diverged` warning event, from the loss the ranks report.

A cross-entropy loss above DIVERGED_FACTOR x ln(vocab) (the loss of a uniform guess over the
vocabulary, which a freshly initialised model starts near) or a non-finite one means the model
predicts worse than knowing nothing: the job's own hyper-parameters (a learning rate too high, no
gradient clipping), never the hardware's, so it is a warning to the user, and the job is neither
failed nor retried for it. Plain functions over a session."""

from __future__ import annotations

import logging
import math
from typing import Any

from sqlalchemy.orm import Session

from service import store
from service.store.models import Job

log = logging.getLogger(__name__)

DIVERGED_EVENT = "loss_diverged"
DIVERGED_FACTOR = 1.5  # x the uniform guess's loss: initialisation noise stays well under it


def uniform_loss(spec: dict[str, Any] | None) -> float | None:
    """ln(vocab) of the job's model; None when the spec does not name one (a stored test job)."""
    from service.schemas import JobSpec

    try:
        return math.log(JobSpec.model_validate(spec or {}).model_spec().vocab)
    except (ValueError, TypeError):
        return None


def check(s: Session, job: Job, doc: dict[str, Any], loss: Any, step: Any) -> None:
    """Append the job's one `loss_diverged` event when its loss has diverged (marks `doc`)."""
    if doc.get(DIVERGED_EVENT) or not isinstance(loss, int | float) or not isinstance(step, int) or step < 1:
        return
    if "uniform_loss" not in doc:
        doc["uniform_loss"] = uniform_loss(job.spec)
    bound = doc["uniform_loss"]
    if bound is None or (math.isfinite(loss) and loss <= DIVERGED_FACTOR * bound):
        return
    train = (job.spec or {}).get("train") or {}
    lr = train.get("lr", "the default")
    message = (f"loss {loss:.4g} at step {step} is above {DIVERGED_FACTOR:g} x ln(vocab) = "
               f"{DIVERGED_FACTOR * bound:.3g} (a uniform guess scores {bound:.3g}): training has diverged. "
               f"This is the job's own setting, not a fault: lower train.lr (now {lr}) or set "
               "train.grad_clip, and resubmit")
    doc[DIVERGED_EVENT] = step
    log.warning("job %s: %s", job.id, message)
    store.append_event(s, job.id, DIVERGED_EVENT, {"message": message, "step": step,
                                                   "loss": loss if math.isfinite(loss) else str(loss),
                                                   "uniform_loss": bound, "lr": train.get("lr")})
