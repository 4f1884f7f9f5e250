"""The integrity checks' running histories in a checkpoint, so that a restart checks its first steps
as the uninterrupted run would, instead of re-learning "normal" over a warm-up after every restore:
the loss spike detector's (the same on every rank) and each rank's own-history gradient check's
(training.integrity.attribution.LocalGradCheck), kept only for the same layout (another layout's
ranks see other local gradients). Saved with the data position in the checkpoint's `extra`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from training.parallel.dist import gather_object


def history_state(trainer: Any) -> dict[str, Any]:
    """Every rank calls it (one all-gather): the histories as `load_history` reads them back."""
    check = trainer.local_check
    grads = gather_object(list(check.detector.history) if check is not None else None)
    return {"loss": list(trainer.spikes.history), "grad": grads, "layout": trainer.cfg.layout.to_dict()}


def load_history(trainer: Any, state: Mapping[str, Any] | None) -> None:
    if not state:
        return
    grads = state.get("grad") or []
    mine = grads[trainer.ctx.rank] if len(grads) == trainer.ctx.world_size else None
    same = state.get("layout") == trainer.cfg.layout.to_dict()
    _load(trainer, state.get("loss"), mine if same else None)


def local_history(trainer: Any) -> dict[str, Any]:
    """This rank's histories, no collective: a peer recovery's kept state carries them
    (training.checkpoint.peer), in the same layout by construction."""
    check = trainer.local_check
    return {"loss": list(trainer.spikes.history),
            "grad": list(check.detector.history) if check is not None else None}


def load_local_history(trainer: Any, state: Mapping[str, Any] | None) -> None:
    """A survivor's own kept histories, or for a replacement those of the DP peer that sent it its
    state: the global loss's is the same, and the peer's local norms are of the same kind of batch
    (a better "normal" than none for the replacement's first steps)."""
    if state:
        _load(trainer, state.get("loss"), state.get("grad"))


def _load(trainer: Any, loss: Any, grad: Any) -> None:
    history = trainer.spikes.history
    history.clear()
    history.extend(float(v) for v in loss or ())
    check = trainer.local_check
    if check is not None and grad is not None:
        check.detector.history.clear()
        check.detector.history.extend(float(v) for v in grad)
