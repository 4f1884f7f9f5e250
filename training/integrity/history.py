"""The integrity checks' running histories in a checkpoint, so that a restart checks its first steps
as the uninterrupted run would, instead of re-learning "normal" over a warm-up after every restore:
the loss spike detector's (the same on every rank) and each rank's own-history gradient check's
(training.integrity.attribution.LocalGradCheck), kept only for the same layout (another layout's
ranks see other local gradients). Saved with the data position in the checkpoint's `extra`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from training.integrity.rerun import gather_object


def history_state(trainer: Any) -> dict[str, Any]:
    """Every rank calls it (one all-gather): the histories as `load_history` reads them back."""
    check = trainer.local_check
    grads = gather_object(list(check.detector.history) if check is not None else None)
    return {"loss": list(trainer.spikes.history), "grad": grads, "layout": trainer.cfg.layout.to_dict()}


def load_history(trainer: Any, state: Mapping[str, Any] | None) -> None:
    if not state:
        return
    loss = trainer.spikes.history
    loss.clear()
    loss.extend(float(v) for v in state.get("loss") or ())
    check, grads = trainer.local_check, state.get("grad") or []
    mine = grads[trainer.ctx.rank] if len(grads) == trainer.ctx.world_size else None
    if check is not None and mine is not None and state.get("layout") == trainer.cfg.layout.to_dict():
        check.detector.history.clear()
        check.detector.history.extend(float(v) for v in mine)
