"""Who corrupted the step: per-rank checks before the DP reduction, pre-step snapshots and the
re-run that attributes a replica mismatch, on top of `training.integrity.fingerprint` (the loop's
side of the re-run is training.integrity.rerun).

Three sources of evidence, cheapest first:

- **Local gradient norm, before the reduction.** Overlapped DDP all-reduces a copy of each
  gradient (its bucket) and writes the average back only in `finish_gradient_synchronization`,
  so between the last backward and that call `p.grad` is still this rank's own gradient. A rank
  whose local norm is non-finite or a spike against its own history is named at once: after the
  all-reduce the corruption is averaged into every replica and nobody can tell whose it was.
- **Majority vote of the replicas' parameter fingerprints** (`integrity.vote_fingerprints`), DP >= 3.
- **Re-run from a pre-step snapshot**, for a vote that cannot decide (DP = 2: two replicas that
  disagree). Every rank restores its parameters and optimizer state from before the step and runs
  the step again. A replica whose first result differs from what the re-run agrees on did not
  reproduce its own step: a transient fault there. When the re-run disagrees again the fault is
  persistent (Megatron's distinction: a transient fault does not reproduce, a persistent one does),
  and with two replicas the re-run alone cannot say which one is wrong.

Everything here is per rank; the train loop (`training.train`) runs the collectives.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.integrity.detectors import GradNormSpikeDetector, IntegrityError
from training.integrity.fingerprint import FingerprintVote
from training.parallel.wrapping import local_tensor

log = logging.getLogger(__name__)

SNAPSHOT_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class AuditConfig:
    """What the train loop checks beyond `RunConfig.integrity` (the hooks carry it: `hooks.audit`)."""

    local_grad_check: bool = True  # each rank's gradient norm before the DP reduction vs its own history
    grad_spike_factor: float = 10.0  # a local norm this many times the running mean is a spike
    grad_warmup: int = 3  # steps that only fill the history
    # Checks inside our DDP's reduction (training.integrity.gradient): the bucket checksum carried
    # through the all-reduce, and each rank's local norm / max |x| against its DP peers' median.
    grad_checks: bool = True
    # Peer-outlier factors. Clean local gradients of bench.sdc's model (micro-batch 1) differ between
    # replicas by up to 26x in norm and 47x in max |x| over 1,000 steps at DP 2 (14x / 20x at DP 3):
    # these leave a margin of 2.4x / 5x and still catch every flip that grows an element by >= 2^16.
    grad_norm_factor: float = 64.0
    grad_max_factor: float = 256.0
    # "auto": snapshot before every step only where a vote can be ambiguous (2 replicas, ZeRO-0);
    # "always": also re-run to tell transient from persistent faults with DP >= 3; "never": no re-run
    # (a statistical check that fires then fails the attempt: the restart re-runs it). Without a
    # snapshot, such a check is re-run before the update (training.integrity.before_update).
    snapshot: str = "auto"

    def __post_init__(self) -> None:
        if self.snapshot not in SNAPSHOT_MODES:
            allowed = ", ".join(SNAPSHOT_MODES)
            raise ValueError(f"audit.snapshot must be one of {allowed}, got {self.snapshot!r}")
        if not self.grad_spike_factor > 1:
            raise ValueError(f"audit.grad_spike_factor must be > 1, got {self.grad_spike_factor}")

    def wants_snapshot(self, dp: int, zero_stage: int) -> bool:
        """Snapshots restore plain optimizers only (ZeRO-0); replicas must exist to disagree."""
        if self.snapshot == "never" or dp < 2 or zero_stage > 0:
            return False
        return self.snapshot == "always" or dp == 2

    def settles_before_update(self, dp: int, zero_stage: int) -> bool:
        """Whether a statistical gradient check that fires is re-run before the optimizer step
        (training.integrity.before_update): where no snapshot is kept, unless re-runs are off."""
        checks = self.local_grad_check or (self.grad_checks and dp > 1)
        return checks and self.snapshot != "never" and not self.wants_snapshot(dp, zero_stage)


def local_grad_norm(params: Sequence[nn.Parameter]) -> float:
    """L2 norm of this rank's gradients as they are now (before the reduction: the local ones)."""
    grads = [local_tensor(p.grad).detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    # One fused pass (torch has no public per-tensor fused norm); an exponent flip gives a huge or inf norm.
    norms = torch._foreach_norm(grads)  # noqa: SLF001
    return float(torch.linalg.vector_norm(torch.stack(norms).double()).item())


class LocalGradCheck:
    """This rank's gradient norm before the reduction against its own recent history."""

    def __init__(self, factor: float = 10.0, warmup: int = 3) -> None:
        self.detector = GradNormSpikeDetector(factor, warmup=warmup)
        self.last: float | None = None

    def check(self, params: Sequence[nn.Parameter], step: int, rank: int) -> IntegrityError | None:
        return self.check_value(local_grad_norm(params), step, rank)

    def check_value(self, value: float, step: int, rank: int) -> IntegrityError | None:
        """`check` of a norm computed elsewhere (the gradient checksums' per-bucket norms)."""
        self.last = value
        try:
            self.detector.check(value, step)
        except IntegrityError as e:
            evidence = {**e.evidence, "grad_norm_local": value if math.isfinite(value) else str(value),
                        "where": "local gradient before the data-parallel reduction"}
            return IntegrityError(e.kind, step, [rank], evidence)
        return None

    def recheck(self, params: Sequence[nn.Parameter]) -> tuple[float, bool]:
        """(norm, bad) for a re-run, without adding to the history."""
        return self.recheck_value(local_grad_norm(params))

    def recheck_value(self, value: float) -> tuple[float, bool]:
        ref = self.detector.reference
        bad = not math.isfinite(value) or (ref is not None and value > self.detector.factor * abs(ref))
        return value, bad


class StepSnapshot:
    """Parameters, optimizer state and RNG of this rank before a step, to run the step again."""

    def __init__(self, parts: Sequence[nn.Module], optimizers: Sequence[Any]) -> None:
        self.parts = list(parts)
        self.optimizers = list(optimizers)
        self.step: int | None = None
        self._params: list[torch.Tensor] = []
        self._optim: list[dict[int, dict[str, Any]]] = []
        self._rng: torch.Tensor | None = None

    def capture(self, step: int) -> None:
        with torch.no_grad():
            params = [p for part in self.parts for p in part.parameters()]
            if len(self._params) != len(params):
                self._params = [local_tensor(p.detach()).clone() for p in params]
            else:
                for buf, p in zip(self._params, params, strict=True):
                    buf.copy_(local_tensor(p.detach()))
            self._optim = []
            for opt in self.optimizers:
                state: dict[int, dict[str, Any]] = {}
                for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
                    st = opt.state.get(p)
                    if st:
                        state[i] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                    for k, v in st.items()}
                self._optim.append(state)
        self._rng = torch.get_rng_state()
        self.step = step

    def restore(self) -> None:
        assert self.step is not None, "restore() before capture()"
        with torch.no_grad():
            params = [p for part in self.parts for p in part.parameters()]
            for buf, p in zip(self._params, params, strict=True):
                local_tensor(p.detach()).copy_(buf)
                p.grad = None
            for opt, saved in zip(self.optimizers, self._optim, strict=True):
                load_optimizer_state(opt, saved)
        if self._rng is not None:
            torch.set_rng_state(self._rng)

    def state(self) -> dict[str, Any]:
        """What `capture` kept (step, parameters, optimizer state by parameter index, RNG)."""
        assert self.step is not None, "state() before capture()"
        return {"step": self.step, "params": self._params, "optim": self._optim, "rng": self._rng}


def load_optimizer_state(opt: Any, saved: dict[int, dict[str, Any]]) -> None:
    """Set `opt`'s per-parameter state from `saved` (by index over its param groups), as copies."""
    for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
        if i in saved:
            opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved[i].items()}
        else:
            opt.state.pop(p, None)


def rerun_verdict(first: FingerprintVote, rerun: FingerprintVote) -> tuple[list[int], bool, dict[str, Any]]:
    """(culprit ranks, transient, evidence) of one DP group from its two votes on the same step.

    The re-run agreeing on one fingerprint means every healthy replica reproduced it: replicas whose
    first fingerprint differs did not reproduce their own step (transient). A re-run that disagrees
    again reproduced the fault (persistent): its own vote names the culprit when it has a strict
    majority, otherwise (two replicas) every rank of the group stays under suspicion.
    """
    evidence: dict[str, Any] = {
        "ranks": first.ranks,
        "fingerprints": [f"{f:032x}" for f in first.fingerprints],
        "rerun_fingerprints": [f"{f:032x}" for f in rerun.fingerprints],
    }
    if rerun.ok:
        agreed = rerun.fingerprints[0]
        culprits = [r for r, f in zip(first.ranks, first.fingerprints, strict=True) if f != agreed]
        pairs = zip(first.ranks, first.fingerprints, strict=True)
        evidence["reproduced"] = {str(r): f == agreed for r, f in pairs}
        return culprits, True, evidence
    evidence["reproduced"] = {str(r): True for r in first.ranks}
    return list(rerun.divergent), False, evidence
