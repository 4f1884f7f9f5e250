"""Replica fingerprints against silent data corruption (SDC): an exact 128-bit fingerprint of a rank's
parameters, and the vote over the data-parallel replicas' fingerprints.

Data-parallel replicas must hold bitwise-identical parameters after every step (they apply the
same averaged gradient to the same weights), so a per-step fingerprint of each replica's local
parameters, all-gathered over the DP group, names a replica whose memory or arithmetic went
wrong. What the fingerprint cannot see: a corrupted *local gradient* before the all-reduce is
averaged into every replica alike: the checks in the DP reduction look for it
(training.integrity.gradient, the opt-in training.integrity.abft).
"""

from __future__ import annotations

import functools
import math
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from training.parallel.dist import all_gather_single
from training.parallel.wrapping import local_tensor

_MASK64 = (1 << 64) - 1
_ROW = 1024  # words per row of the position-weighted sum
_COL_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant (golden ratio), as signed int64
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer dtypes


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's bits as (main, tail) int64 tensors, no copy of the bulk when contiguous.

    `main` packs 8 bytes of elements per int64 word (two float32s, four bf16s: an integer
    reduction over int64 runs ~25x faster on CPU than widening int32 words one by one); `tail`
    holds the last elements that do not fill a word (and a misaligned view), each widened to int64.
    """
    t = local_tensor(t.detach())
    if not t.is_contiguous():
        t = t.contiguous()
    w = t.view(INT_OF_SIZE[t.element_size()]).reshape(-1)
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
    all_gather_single(gathered, mine, group=group)
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
    all_gather_single(gathered, mine)
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
