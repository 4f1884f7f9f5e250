"""Checks that fail a step, and the error they raise: a non-finite loss, a loss or gradient-norm
spike against recent history (`IntegrityError` kinds nonfinite, loss_spike, grad_norm_spike; the
replica vote adds divergent_replicas)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from training.parallel.wrapping import local_tensor


class IntegrityError(RuntimeError):
    """A failed integrity check. kind: nonfinite | loss_spike | grad_norm_spike | divergent_replicas |
    grad_checksum | grad_norm_outlier | grad_abft (training.integrity.gradient, .abft)."""

    def __init__(
        self,
        kind: str,
        step: int,
        ranks: Sequence[int] = (),
        evidence: dict[str, Any] | None = None,
        message: str | None = None,
    ) -> None:
        self.kind = kind
        self.step = step
        self.ranks = list(ranks)
        self.evidence = dict(evidence or {})
        super().__init__(message or f"{kind} at step {step} on ranks {self.ranks}: {self.evidence}")


def _this_rank() -> list[int]:
    return [dist.get_rank()] if dist.is_available() and dist.is_initialized() else []


def json_number(value: Any) -> Any:
    """`value` as an integrity error's evidence stores it: a non-finite float as its string (JSON,
    and PostgreSQL's JSON, have no NaN or infinity); anything else unchanged."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _as_float(value: torch.Tensor | float) -> float:
    return float(value.detach().float().item()) if isinstance(value, torch.Tensor) else float(value)


def check_finite(loss: torch.Tensor | float, step: int) -> None:
    """Raise IntegrityError("nonfinite") when the loss is NaN or +-Inf."""
    value = _as_float(loss)
    if not math.isfinite(value):
        raise IntegrityError("nonfinite", step, _this_rank(), {"loss": value})


class _SpikeDetector:
    """A value above `factor` x the mean of the last `window` accepted values is a spike.

    The first `warmup` values only fill the window. Spikes are not added to the window, so one bad
    step does not raise the bar for the next. Non-finite values raise kind "nonfinite".
    """

    kind = "spike"
    what = "value"

    def __init__(self, factor: float = 10.0, warmup: int = 3, window: int = 20) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor must be > 1, got {factor}")
        if warmup < 1 or window < warmup:
            raise ValueError(f"need 1 <= warmup <= window, got warmup={warmup} window={window}")
        self.factor = factor
        self.warmup = warmup
        self.history: deque[float] = deque(maxlen=window)

    @property
    def reference(self) -> float | None:
        return sum(self.history) / len(self.history) if len(self.history) >= self.warmup else None

    def check(self, value: torch.Tensor | float, step: int) -> None:
        v = _as_float(value)
        if not math.isfinite(v):
            raise IntegrityError("nonfinite", step, _this_rank(), {self.what: v})
        ref = self.reference
        if ref is not None and v > self.factor * abs(ref):
            raise IntegrityError(
                self.kind, step, _this_rank(), {self.what: v, "reference": ref, "factor": self.factor}
            )
        self.history.append(v)


class LossSpikeDetector(_SpikeDetector):
    kind = "loss_spike"
    what = "loss"


class GradNormSpikeDetector(_SpikeDetector):
    """On the global gradient norm: catches an exponent flip in a local gradient before the all-reduce,
    which every replica then applies alike (so the fingerprints still agree)."""

    kind = "grad_norm_spike"
    what = "grad_norm"


def grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of the local gradients (after DDP's all-reduce this is the global norm on every replica).

    In float64, so that an exponent flip (~1e38 in float32) gives a huge finite norm, not inf.
    """
    norms = [local_tensor(p.grad).detach().double().norm() for p in params if p.grad is not None]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]))
