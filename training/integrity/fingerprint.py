"""Primitives against silent data corruption (SDC): fingerprints, replica votes, finiteness and
spike checks, and a bit-flip injector for tests.

Data-parallel replicas must hold bitwise-identical parameters after every step (they apply the
same averaged gradient to the same weights), so a per-step fingerprint of each replica's local
parameters, all-gathered over the DP group, names a replica whose memory or arithmetic went
wrong. What the fingerprint cannot see: a corrupted *local gradient* before the all-reduce is
averaged into every replica alike; an exponent flip there shows up in the global gradient norm
(`GradNormSpikeDetector`) or as a non-finite loss (`check_finite`).
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from training.parallel.ddp import local_tensor

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_ROW = 1024  # words per row of the position-weighted sum
_COL_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant (golden ratio), as signed int64
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class IntegrityError(RuntimeError):
    """A failed integrity check. kind: nonfinite | loss_spike | grad_norm_spike | divergent_replicas."""

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


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's bits as (main, tail) int64 tensors, no copy of the bulk when contiguous.

    `main` packs 8 bytes of elements per int64 word (two float32s, four bf16s: an integer
    reduction over int64 runs ~25x faster on CPU than widening int32 words one by one); `tail`
    holds the last elements that do not fill a word (and a misaligned view), each widened to int64.
    """
    t = local_tensor(t.detach())
    if not t.is_contiguous():
        t = t.contiguous()
    w = t.view(_INT_OF_SIZE[t.element_size()]).reshape(-1)
    per_word = 8 // t.element_size()
    n_main = w.numel() // per_word * per_word
    try:
        main = w[:n_main].view(torch.int64)
    except RuntimeError:  # storage offset not 8-byte aligned: widen instead (same detection argument)
        return w.new_empty(0, dtype=torch.int64), w.to(torch.int64)
    return main, w[n_main:].to(torch.int64)


@functools.lru_cache(maxsize=16)
def _weights(shapes: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per-word weights of `param_fingerprint` for tensors of (main words, tail words), as int64:
    for the rows and for the rest (tail and short last row), m_t = 2t+1 (into hi) and m_t times the
    row weight (into lo); for the (T, _ROW) column sums, m_t times the column weight."""
    row_hi, row_lo, rest_hi, rest_lo, col = [], [], [], [], []
    for t, (n_main, n_tail) in enumerate(shapes):
        m = 2 * t + 1
        n_rows = n_main // _ROW
        n_rest = n_main - n_rows * _ROW + n_tail
        row_hi += [m] * n_rows
        row_lo += [m * r for r in range(1, n_rows + 1)]
        rest_hi += [m] * n_rest
        # the short last row counts as row n_rows + 1 and its words by column (c + 1), mixed by M
        rest_lo += [m * (n_rows + 1) + m * (c + 1) * _COL_MIX for c in range(n_rest)]
        col += [m * (c + 1) * _COL_MIX for c in range(_ROW)]
    def wrap(v: list[int]) -> torch.Tensor:
        return torch.tensor([((x + (1 << 63)) & _MASK64) - (1 << 63) for x in v], dtype=torch.int64,
                            device=device)
    return wrap(row_hi), wrap(row_lo), wrap(rest_hi), wrap(rest_lo), wrap(col).view(len(shapes), _ROW)


def _fingerprint_words(words: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """F of `param_fingerprint` from each tensor's (main, tail) int64 words: per tensor one row-sum
    and one column-sum reduction, then three small weighted sums (arithmetic wraps mod 2^64)."""
    device = words[0][0].device
    rows, cols, rest = [], [], []
    for main, tail in words:
        n_rows = main.numel() // _ROW
        block = main[: n_rows * _ROW].view(-1, _ROW)
        rows.append(block.sum(dim=1))
        cols.append(block.sum(dim=0))
        rest += [main[n_rows * _ROW:], tail]
    row_hi, row_lo, rest_hi, rest_lo, col_w = _weights(
        tuple((m.numel(), t.numel()) for m, t in words), device)
    rows_all, rest_all = torch.cat(rows), torch.cat(rest)
    hi = (rows_all * row_hi).sum() + (rest_all * rest_hi).sum()
    lo = (rows_all * row_lo).sum() + (rest_all * rest_lo).sum() + (torch.stack(cols) * col_w).sum()
    hi_v, lo_v = torch.stack([hi, lo]).cpu().tolist()
    return ((hi_v & _MASK64) << 64) | (lo_v & _MASK64)


def param_fingerprint(model_parts: Sequence[nn.Module]) -> int:
    """An exact 128-bit fingerprint of this rank's local parameters (every part, in parameter order).

    For tensor t (its bytes read as signed 64-bit integers, "words", `_words`), viewed as rows of
    _ROW words (the rest is one short last row):
      F = (sum_t (2t+1) S_t mod 2^64) << 64  |  (sum_t (2t+1) P_t mod 2^64)
    with S_t the exact sum of the words and P_t = sum_r (r+1) rowsum_r + M sum_c (c+1) colsum_c a
    row/column position-weighted sum (M odd). Any single bit flip changes F: flipping bit k of an
    element changes its word by +-2^j for the word bit j < 64 it sits in, so S_t changes by
    d = +-2^j != 0 mod 2^64, and (2t+1) d != 0 mod 2^64 because 2t+1 is odd (a unit mod 2^64).
    P_t adds position sensitivity (moved or swapped elements change it; two elements swapped
    inside one word change the word itself). The cost is two int64 reductions over the parameters
    (no widening) and one device-to-host copy at the end.
    """
    words = [_words(p) for part in model_parts for p in part.parameters()]
    return _fingerprint_words(words) if words else 0


@dataclass(frozen=True)
class FingerprintVote:
    """The outcome of comparing replicas' fingerprints.

    `ranks` are the global ranks of the DP group in group order; `fingerprints` align with them.
    `divergent`: the ranks outside the strict majority; when no fingerprint has a strict majority
    (two replicas that disagree, a 2-2 split) the vote is `ambiguous` and `divergent` holds the
    ranks outside the unique largest agreeing set, or every rank when there is no unique largest
    set: the caller re-runs the step to attribute the fault.
    """

    ranks: list[int]
    fingerprints: list[int]
    divergent: list[int] = field(default_factory=list)
    majority: int | None = None
    ambiguous: bool = False

    @property
    def ok(self) -> bool:
        return not self.divergent


def vote(fingerprints: Sequence[int], ranks: Sequence[int]) -> FingerprintVote:
    """Majority vote over replicas' fingerprints (pure; `vote_fingerprints` does the all_gather)."""
    if len(fingerprints) != len(ranks):
        raise ValueError(f"{len(fingerprints)} fingerprints for {len(ranks)} ranks")
    counts = Counter(fingerprints).most_common()
    if len(counts) <= 1:
        return FingerprintVote(list(ranks), list(fingerprints), [], counts[0][0] if counts else None, False)
    top, top_count = counts[0]
    if top_count * 2 > len(fingerprints):
        divergent = [r for r, f in zip(ranks, fingerprints, strict=True) if f != top]
        return FingerprintVote(list(ranks), list(fingerprints), divergent, top, False)
    if top_count > counts[1][1]:
        divergent = [r for r, f in zip(ranks, fingerprints, strict=True) if f != top]
        return FingerprintVote(list(ranks), list(fingerprints), divergent, top, True)
    return FingerprintVote(list(ranks), list(fingerprints), list(ranks), None, True)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_fingerprint(fingerprint: int) -> list[int]:
    """A 128-bit fingerprint as 4 x 32-bit words (each fits an int64 exactly)."""
    return [(fingerprint >> (32 * i)) & 0xFFFFFFFF for i in range(4)]


def _join_fingerprint(words: Sequence[int]) -> int:
    return sum(int(w) << (32 * i) for i, w in enumerate(words))


def vote_fingerprints(fingerprint: int, dp_group: dist.ProcessGroup | None) -> FingerprintVote:
    """All-gather every replica's 128-bit fingerprint over `dp_group` (None = world) and vote."""
    group = dp_group if dp_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    mine = torch.tensor(_split_fingerprint(fingerprint), dtype=torch.int64, device=_collective_device(group))
    gathered = torch.empty(len(ranks) * 4, dtype=torch.int64, device=mine.device)
    dist.all_gather_single(gathered, mine, group=group)
    rows = gathered.view(len(ranks), 4).cpu().tolist()
    values = [_join_fingerprint(row) for row in rows]
    return vote(values, ranks)


def summarize_step(
    loss: float, fingerprint: int | None, dp_group: dist.ProcessGroup | None, device: torch.device,
    contributors: int,
) -> tuple[float, FingerprintVote | None]:
    """All-gather (loss, fingerprint) from every rank in one collective over the world.

    Returns the sum of the gathered losses / `contributors` (the ranks that hold a loss; the others
    send 0) and, when `fingerprint` is given (it must be on every rank alike), the vote of the
    ranks in `dp_group` (None = world). The loss travels as its float64 bits, so it is exact.
    """
    world = dist.get_world_size()
    words = [struct.unpack("<q", struct.pack("<d", loss))[0], *_split_fingerprint(fingerprint or 0)]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    gathered = torch.empty(world * 5, dtype=torch.int64, device=device)
    dist.all_gather_single(gathered, mine)
    rows = gathered.view(world, 5).cpu().tolist()
    total = math.fsum(struct.unpack("<d", struct.pack("<q", row[0]))[0] for row in rows)
    if fingerprint is None:
        return total / contributors, None
    group = dp_group if dp_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    values = [_join_fingerprint(rows[r][1:]) for r in ranks]
    return total / contributors, vote(values, ranks)


def find_divergent_replicas(fingerprint: int, dp_group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks whose fingerprint disagrees with the majority of the DP group ([] when all agree).

    Two replicas that disagree both come back; use `vote_fingerprints(...).ambiguous` to tell.
    """
    return vote_fingerprints(fingerprint, dp_group).divergent


def _this_rank() -> list[int]:
    return [dist.get_rank()] if dist.is_available() and dist.is_initialized() else []


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


def flip_bit(tensor: torch.Tensor, flat_index: int, bit: int) -> None:
    """Flip bit `bit` (0 = least significant) of element `flat_index` of `tensor`, in place.

    Works for any floating (or integer) dtype by reading the element's bits as a same-width integer;
    for float32 bits 23..30 are the exponent, 31 the sign.
    """
    words = _words_inplace(tensor)
    nbits = words.element_size() * 8
    if not 0 <= bit < nbits:
        raise ValueError(f"bit must be in [0, {nbits}) for {tensor.dtype}, got {bit}")
    if not 0 <= flat_index < words.numel():
        raise ValueError(f"index must be in [0, {words.numel()}), got {flat_index}")
    mask = (1 << bit) if bit < nbits - 1 or words.dtype == torch.uint8 else -(1 << bit)
    with torch.no_grad():
        words[flat_index] = words[flat_index] ^ mask


def _words_inplace(tensor: torch.Tensor) -> torch.Tensor:
    t = local_tensor(tensor.detach())
    if not t.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor")
    return t.view(_INT_OF_SIZE[t.element_size()]).view(-1)


@dataclass(frozen=True)
class BitFlip:
    """Flip bit `bit` of element `index` of the parameter (or its gradient) `name` on `rank` at `step`
    (`persistent`: every time the step runs on this rank, re-runs included)."""

    step: int
    rank: int
    target: Literal["param", "grad"]
    name: str
    index: int
    bit: int
    # A faulty device rather than a one-off upset: the flip happens again each time this process
    # runs the step (a re-run from the pre-step snapshot reproduces it).
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.target not in ("param", "grad"):
            raise ValueError(f"BitFlip.target must be 'param' or 'grad', got {self.target!r}")


def _strip_wrappers(name: str) -> str:
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


class BitFlipInjector:
    """Applies the `BitFlip`s meant for this rank. Names match exactly or after dropping wrapper
    prefixes (`module.` of DDP, `_orig_mod.` of torch.compile, ...). Each flip is applied at most once,
    so the methods may be called once per model part.

    A persistent flip applies at every call for its step (call each method once per execution of
    the step then, with every part's parameters).

    Gradient flips, two ways:
    - `maybe_flip_grads` flips `.grad` in place: call it after backward, before the gradients are
      reduced (NaiveDDP/FlatDDP reduce in `finish_gradient_synchronization`; one rank; pipelines).
    - `arm_grad_flips` (call before backward) flips the gradient as autograd produces it, before
      any accumulate-grad hook sees it: needed with the overlapped `DDP` (and torch DDP), which
      reduce gradients during backward, so a flip after backward would be overwritten.
    """

    def __init__(self, flips: Iterable[BitFlip], rank: int) -> None:
        self.rank = rank
        self.flips = [f for f in flips if f.rank == rank]
        self.applied: list[BitFlip] = []
        self._armed: list[tuple[BitFlip, Any]] = []

    def _due(self, step: int, target: str) -> list[BitFlip]:
        armed = {f for f, _ in self._armed}
        return [f for f in self.flips if f.step == step and f.target == target
                and (f.persistent or f not in self.applied) and f not in armed]

    @staticmethod
    def _lookup(name: str, named_params: dict[str, nn.Parameter]) -> nn.Parameter | None:
        if name in named_params:
            return named_params[name]
        clean = _strip_wrappers(name)
        return next((p for n, p in named_params.items() if _strip_wrappers(n) == clean), None)

    def _apply(
        self, step: int, target: str, named_params: Iterable[tuple[str, nn.Parameter]]
    ) -> list[BitFlip]:
        due = self._due(step, target)
        if not due:
            return []
        params = dict(named_params)
        done = []
        for f in due:
            p = self._lookup(f.name, params)
            if p is None:
                continue
            t = p if target == "param" else p.grad
            if t is None:
                log.warning("bit flip %s: parameter %s has no gradient at step %d", f, f.name, step)
                continue
            flip_bit(t, f.index, f.bit)
            log.info("injected %s", f)
            self.applied.append(f)
            done.append(f)
        return done

    def maybe_flip_params(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        return self._apply(step, "param", named_params)

    def maybe_flip_grads(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        return self._apply(step, "grad", named_params)

    def arm_grad_flips(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        """Register one-shot gradient hooks for this step's grad flips (see the class docstring)."""
        for _, handle in self._armed:  # hooks from earlier steps have fired (or are stale): drop them
            handle.remove()
        self._armed = []
        due = self._due(step, "grad")
        params = dict(named_params)
        armed = []
        for f in due:
            p = self._lookup(f.name, params)
            if p is None:
                continue

            def hook(grad: torch.Tensor, f: BitFlip = f) -> torch.Tensor | None:
                if f in self.applied and not f.persistent:
                    return None
                corrupted = grad.clone()
                flip_bit(corrupted, f.index, f.bit)
                log.info("injected %s", f)
                self.applied.append(f)
                return corrupted

            self._armed.append((f, p.register_hook(hook)))
            armed.append(f)
        return armed
