"""Gradient SDC checks around the data-parallel all-reduce (our DDP, so ZeRO-0 and ZeRO-1).

A corrupted local gradient is averaged into every replica by the all-reduce, so the replicas'
parameter fingerprints still agree afterwards and the vote sees nothing. Two checks run on the
bucket buffers of `training.parallel.ddp.DDP`, with one tiny all-gather per step:

- **Linear checksum carried through the reduction** (`grad_checksum`). At pack time each rank
  computes the sum and the absolute sum of its local bucket. The all-reduce is linear, so after it
  sum(reduced bucket) must equal the sum of the ranks' local sums up to floating-point rounding:
  at most (world - 1) u sum|x| for the element-wise additions of the reduction plus the rounding of
  our own sums (Higham, "Accuracy and Stability of Numerical Algorithms", 2002, eq. 4.4: recursive
  summation of m terms errs by at most (m - 1) u sum|x_i|). A rank whose reduced bucket breaks the
  identity is named: it catches corruption that enters after the local gradient was packed (in the
  communication buffers, the transport, the reduction arithmetic). It cannot see a gradient that
  was already wrong when packed: the checksum is computed over the wrong values.
- **Per-rank norm outliers against the DP peers** (`grad_norm_outlier`). The same gather carries
  each rank's local L2 norm and max |x| per bucket. Replicas see different data but the same model,
  so their local gradients have similar scale; a rank whose norm or max |x| is non-finite or more
  than `factor` times the median of its peers' is named. Exponent flips that grow an element (the
  dangerous ones: an exponent flip can move a weight by orders of magnitude) stand out at once;
  flips that keep the scale (mantissa, sign, an exponent bit that halves or doubles a small value)
  do not, and are bounded by the optimizer's per-element step (AdamW moves a weight by about lr
  per step whatever the gradient's size).

The checks only read the buffers: a clean run's results are bitwise unchanged. Errors are kept on
the audit (`GradientAudit.error`) for the train loop, which agrees on them with every rank and
re-runs the step from the snapshot where there is one (training.integrity.rerun).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training.integrity.detectors import IntegrityError, json_number
from training.parallel.dist import all_gather_single

log = logging.getLogger(__name__)

GRAD_CHECK_KINDS = ("grad_checksum", "grad_norm_outlier", "grad_abft")  # grad_abft: training.integrity.abft
_ROW = 256  # elements per fp32 partial sum: each row's rounding is bounded by (_ROW - 1) u sum|row|
_STATS = 4  # per bucket and rank: sum, >= sum|x|, L2 norm, max|x| (plus the reduced sum after the reduction)


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` as float64 from float32 partial sums of `_ROW` elements (one pass, no fp64 copy)."""
    n_main = x.numel() // _ROW * _ROW
    main = x[:n_main].view(-1, _ROW).sum(dim=1).double().sum()  # rows in x's dtype (fp32 or fp64)
    return main + x[n_main:].double().sum()


def _as_sum_dtype(buffer: torch.Tensor) -> torch.Tensor:
    """Half-precision buckets are summed in float32 (their own eps would swamp the check)."""
    flat = buffer.detach().reshape(-1)
    return flat.float() if flat.element_size() < 4 else flat


def bucket_stats(buffer: torch.Tensor) -> torch.Tensor:
    """[sum, a bound on sum|x|, ||x||_2, max|x|] of a local bucket, float64, on the bucket's device.

    Three passes over the bucket (row sums, the norm, min and max). sum|x| is bounded by
    sqrt(n) ||x||_2 (Cauchy-Schwarz) instead of a fourth pass: it only scales the tolerance, ~1.25x
    looser than the exact value for dense Gaussian-like gradients.
    """
    x = _as_sum_dtype(buffer)
    if x.numel() == 0:
        return torch.zeros(_STATS, dtype=torch.float64, device=x.device)
    (norm,) = torch._foreach_norm([x])  # noqa: SLF001 - the fastest fused norm on CPU and GPU
    low, high = torch.aminmax(x)
    norm = norm.double()
    return torch.stack([_row_sums(x), norm * math.sqrt(x.numel()), norm,
                        torch.maximum(low.abs(), high.abs()).double()])


def reduced_sum(buffer: torch.Tensor) -> torch.Tensor:
    """Sum of a reduced bucket, computed as the local checksums are (float64 from fp32 rows)."""
    x = _as_sum_dtype(buffer)
    return _row_sums(x) if x.numel() else torch.zeros((), dtype=torch.float64, device=x.device)


def checksum_tolerance(abs_total: float, world: int, reduce_dtype: torch.dtype) -> float:
    """Largest |sum(reduced) - sum of local sums| that rounding alone can produce.

    (world - 1) u_r A for the reduction's element-wise additions in `reduce_dtype` and (_ROW - 1) u
    A for each of our two fp32-row sums (Higham 2002, eq. 4.4), A = sum over ranks of sum|x|; eps
    (= 2u) instead of u gives a factor 2 of margin, and the float64 steps add far less than that.
    """
    eps_reduce = torch.finfo(reduce_dtype).eps
    eps_sum = torch.finfo(torch.float32 if torch.finfo(reduce_dtype).bits < 32 else reduce_dtype).eps
    return ((world - 1) * eps_reduce + 2 * (_ROW - 1) * eps_sum) * abs_total + 1e-300


def checksum_mismatches(local: Sequence[Sequence[float]], reduced: Sequence[float], world: int,
                        reduce_dtype: torch.dtype) -> list[tuple[int, float, float]]:
    """For one bucket: (group index, |difference|, tolerance) of each rank whose reduced sum breaks
    sum(reduced) = sum_r local_sum_r. `local[r]` is rank r's bucket_stats; `reduced[r]` its reduced
    sum. Buckets with a non-finite local sum are left to the outlier check (nothing to compare)."""
    sums, abs_sums = [s[0] for s in local], [s[1] for s in local]
    if not all(math.isfinite(v) for v in sums + abs_sums):
        return []
    expected = math.fsum(sums)
    tol = checksum_tolerance(math.fsum(abs_sums), world, reduce_dtype)
    out = []
    for r, got in enumerate(reduced):
        diff = abs(got - expected)
        if not diff <= tol:  # NaN compares False: a non-finite reduced sum is a mismatch
            out.append((r, diff, tol))
    return out


def norm_outliers(values: Sequence[float], factor: float) -> list[int]:
    """Group indices whose value is non-finite or above `factor` x the median of the others'.

    All non-finite (the whole job diverged alike) names nobody: no rank's hardware is to blame.
    """
    if len(values) < 2:
        return []
    bad = [r for r, v in enumerate(values) if not math.isfinite(v)]
    if len(bad) == len(values):
        return []
    for r, v in enumerate(values):
        if r in bad:
            continue
        ref = statistics.median(values[:r] + values[r + 1:])
        if math.isfinite(ref) and ref > 0 and v > factor * ref:
            bad.append(r)
    return sorted(bad)


class GradientAudit:
    """The checks of one DDP module (see the module docstring); `DDP.grad_audit` holds it.

    DDP calls `record(bucket, buffer)` when it packs a bucket and `verify(buckets)` after every
    reduction finished, before the average is copied back; the train loop calls `begin(step)`
    before backward and reads `error` after the synchronization.
    """

    def __init__(self, group: dist.ProcessGroup | None, names: dict[int, str], norm_factor: float = 64.0,
                 max_factor: float = 256.0, checksum: bool = True, outliers: bool = True) -> None:
        if not norm_factor > 1 or not max_factor > 1:
            raise ValueError(f"outlier factors must be > 1, got {norm_factor}, {max_factor}")
        self.group = group
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.names = names  # id(parameter) -> name, for injected corruption of the reduced bucket
        self.norm_factor, self.max_factor = norm_factor, max_factor
        self.checksum, self.outliers = checksum, outliers
        self.step = 0
        self.error: IntegrityError | None = None
        self.local_norm = 0.0  # this rank's L2 norm over every bucket before the reduction (last step)
        self.last: dict[str, Any] = {}  # the last step's gathered statistics (bench and tests read them)
        # Tests and bench.sdc: called with (step, [(name, reduced view)]) after the reduction.
        self.corrupt_reduced: Callable[[int, list[tuple[str, torch.Tensor]]], Any] | None = None
        self._local: dict[int, torch.Tensor] = {}

    def begin(self, step: int) -> None:
        self.step, self.error = step, None
        self._local.clear()

    def record(self, bucket_index: int, buffer: torch.Tensor) -> None:
        """The bucket as packed (local gradients), before its all-reduce is launched."""
        self._local[bucket_index] = bucket_stats(buffer)

    def verify(self, buckets: Sequence[tuple[Sequence[nn.Parameter], Sequence[torch.Tensor], torch.Tensor]]
               ) -> IntegrityError | None:
        """All-gather every rank's statistics and reduced sums over the group and judge them.

        `buckets`: (params, their views, buffer) per bucket, reduced (summed, not yet averaged).
        """
        if self.corrupt_reduced is not None:
            self.corrupt_reduced(self.step, [(self.names.get(id(p), ""), v) for ps, vs, _ in buckets
                                             for p, v in zip(ps, vs, strict=True)])
        device = buckets[0][2].device
        rows = [torch.cat([self._local[i].to(device), reduced_sum(buf).view(1)]) for i, (_, _, buf)
                in enumerate(buckets)]
        mine = torch.cat(rows)
        world = len(self.ranks)
        gathered = torch.empty(world * mine.numel(), dtype=mine.dtype, device=device)
        all_gather_single(gathered, mine, group=self.group)
        table = gathered.view(world, len(buckets), _STATS + 1).cpu().tolist()  # the step's one host sync
        # this rank's local norms, read from the gathered table (no host sync of their own)
        self.local_norm = math.sqrt(sum(b[2] ** 2 for b in table[self.ranks.index(dist.get_rank())]))
        self.last = {"norms": [[b[2] for b in r] for r in table], "max": [[b[3] for b in r] for r in table]}
        self.error = self._judge(table, [buf.dtype for _, _, buf in buckets])
        return self.error

    def _judge(self, table: list[list[list[float]]], dtypes: list[torch.dtype]) -> IntegrityError | None:
        world = len(self.ranks)
        for i, dtype in enumerate(dtypes):
            local = [table[r][i][:_STATS] for r in range(world)]
            if self.outliers:
                norms, maxes = [s[2] for s in local], [s[3] for s in local]
                named = sorted(set(norm_outliers(norms, self.norm_factor))
                               | set(norm_outliers(maxes, self.max_factor)))
                if named:
                    return IntegrityError("grad_norm_outlier", self.step, [self.ranks[r] for r in named], {
                        "bucket": i, "norms": [json_number(v) for v in norms],
                        "max_abs": [json_number(v) for v in maxes],
                        "factor": self.norm_factor, "max_factor": self.max_factor, "dp_group": self.ranks,
                        "where": "local gradient norm against the data-parallel peers, before the reduction"})
            if self.checksum:
                bad = checksum_mismatches(local, [table[r][i][_STATS] for r in range(world)], world, dtype)
                if bad:
                    return IntegrityError("grad_checksum", self.step, [self.ranks[r] for r, _, _ in bad], {
                        "bucket": i, "difference": [json_number(d) for _, d, _ in bad],
                        "tolerance": bad[0][2],
                        "dp_group": self.ranks, "every_rank": len(bad) == world,
                        "where": "sum of the reduced bucket against the ranks' local checksums"})
        return None




def attach_gradient_audits(modules: Sequence[nn.Module], audit: Any, injector: Any = None,
                           outliers: bool = True) -> list[GradientAudit]:
    """A GradientAudit on each of our DDP wrappers with more than one replica (others get none), per
    `audit` (attribution.AuditConfig; None or grad_checks off: none); `injector` (a BitFlipInjector)
    may corrupt the reduced buckets ("reduce" bit flips). `outliers` False (MoE: each replica routes
    its own tokens, so expert gradients legitimately differ by orders of magnitude) keeps only the
    checksum."""
    from training.parallel.ddp import DDP

    if audit is None or not audit.grad_checks:
        return []
    audits = []
    for m in modules:
        if isinstance(m, DDP) and m.world_size > 1:
            names = {id(p): n for n, p in m.named_parameters()}
            m.grad_audit = GradientAudit(m.process_group, names, audit.grad_norm_factor,
                                         audit.grad_max_factor, outliers=outliers)
            if injector is not None:
                m.grad_audit.corrupt_reduced = injector.maybe_flip_reduced
            audits.append(m.grad_audit)
    return audits


def take_gradient_checks(trainer: Any, step: int, rerun: bool) -> None:
    """After the DP reduction: the trainer's (training.train.Trainer) local error or re-run report
    from the checks that ran inside it (`grad_audits`, `abft`). With the checksums, the local norm
    check (`local_check`, attribution.LocalGradCheck) reads their norms: no pass of its own."""
    audits = [*trainer.grad_audits, *([trainer.abft] if trainer.abft is not None else [])]
    check = trainer.local_check
    if trainer.grad_audits and check is not None:
        norm = math.sqrt(sum(a.local_norm**2 for a in trainer.grad_audits))
        if rerun:
            trainer.rerun_local = check.recheck_value(norm)
        else:
            trainer._local_error = check.check_value(norm, step, trainer.ctx.rank)  # noqa: SLF001
    error = next((a.error for a in audits if a.error is not None), None)
    if rerun and audits:
        value, bad = trainer.rerun_local if check is not None and trainer.rerun_local else (0.0, False)
        trainer.rerun_local = (value, bad or (error is not None and trainer.ctx.rank in error.ranks))
    elif error is not None and trainer._local_error is None:  # noqa: SLF001
        trainer._local_error = error  # noqa: SLF001
