"""Algorithm-based fault tolerance (ABFT) for the weight gradients (`integrity.abft`):
Huang & Abraham, "Algorithm-Based Fault Tolerance for Matrix Operations", IEEE Trans. Computers,
1984 — a matrix product carries a checksum that a cheap product predicts.

A linear layer's weight gradient is G = dY^T X (dY: (T, out), X: (T, in), T tokens). Its column
checksum is predicted by a matrix-vector product, O(T (in + out)) against the GEMM's O(T in out):

    1^T G = (dY 1)^T X        (the sum over the output rows of G, one value per input column)

computed from the layer's input and output gradient as backward produces them, and compared with
the gradient the rank is about to reduce (`p.grad` before the DP reduction, summed over its rows).
An embedding's gradient (dY summed per token id) has 1^T G = 1^T dY. An RMSNorm's weight gradient
G_j = sum_t dY_tj n_tj (n the normalised input, Y = n w its output) is checked whole, as
w_j G_j = sum_t dY_tj Y_tj: the output is at hand, so nothing of the forward is recomputed.

Tolerance: probabilistic, not worst-case. Rounding errors of a float sum behave like a random walk:
Higham & Mary ("A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41,
2019, Thm 3.1) bound a sum of n terms by lambda sqrt(n) u sum|x_i| with probability at least
1 - 2 exp(-lambda^2 / 2) (worst case: n u sum|x_i|). A linear layer's checksum is one sum of the
T x out products dY_ti X_tj, ~T + out roundings on each term's path; its partial sums are bounded
(Cauchy-Schwarz) by (||dY||_F + ||dY 1||_2) ||X_:j||_2, the second term for gradients whose rows
add up coherently (low rank). Per column, with n = T + out + passes (eps = 2u; TF32 GEMMs: 2^-10):

    |difference_j| <= eps min(n, LAMBDA sqrt(n)) (||dY||_F + ||dY 1||_2) ||X_:j||_2

Embeddings and norms use Higham & Mary's sum|x| per column directly. bf16 gradients: the GEMM and
our sums accumulate in fp32 (the prediction's row sums are kept in fp32 as two bf16 halves), and
what rounds to bf16, each element of G, adds eps_bf16 LAMBDA (||G_:j||_2 + |prediction_j|) (a
random walk over the column): a change is caught above 1.6x the column's RMS element at T = 1024,
out = 1024 (0.96x at out = 256; measured) — bf16 gradients carry that much rounding. Where the old worst-case
bound ((T + 2 out) eps sum|dY||X|) needed a change of 7.7x the column's RMS element to fire at
T = in = out = 1024, this one fires at 0.044x: a sign flip is caught unless the element is ~1/45
of typical (measured; bench.sdc prints the margin on clean steps, LAMBDA below).

Cost (bench.sdc measures it): per linear layer two reductions of dY (its row sums and its norm) and
one matrix-vector product with X; the column norms of X once per input, in the forward hook (X is
in cache), shared by the projections that read it (q, k, v; w1, w3). |X| and |dY| are no longer
materialised for a linear layer (on CPU the squares of X are, once per input). The comparison at
the end of backward is one pass over each gradient (its column sums), then batched over all layers:
the linear layers' error scales in one stack, one fused norm and one product, every tolerance in
one multiply, one host sync. The hooks compute on detached tensors (no autograd context to enter).

Scope: `nn.Linear`, `nn.Embedding` (dense, no padding row) and RMSNorm weights used by no other
module (a tied weight gets other gradients too), not DTensor (TP/FSDP) weights, and pipeline
parallel off (the schedule interleaves micro-batches; the hooks pair each layer's last input with
its output gradient). It keeps a reference to each layer's input until its backward (autograd
keeps them anyway, except under activation recompute).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.integrity.detectors import IntegrityError, json_number
from training.model.transformer import RMSNorm

# Higham & Mary's lambda (P(one sum exceeds) <= 2 exp(-8) in their model, which ignores the
# cancellation real gradients have). Measured, the largest clean |difference| / tolerance was 0.26
# over 1,000 steps at DP 3 and 0.23 at DP 2 (bench.sdc's model, T = 16, fp32), 0.22 in bf16, 0.015
# at T = 1024 (hidden 256): 4x margin where the sums are short, 60x+ at realistic sizes.
LAMBDA = 4.0
_vnorm = torch.linalg.vector_norm


def _eligible(m: nn.Module) -> bool:
    if isinstance(m, nn.Embedding) and (m.padding_idx is not None or m.sparse):
        return False  # the padding row's gradient is zeroed; sparse gradients have no dense sum
    return isinstance(m, nn.Linear | nn.Embedding | RMSNorm) and not isinstance(m.weight, DTensor)


def _eps(grad: torch.Tensor) -> float:
    eps = torch.finfo(grad.dtype).eps
    if grad.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        eps = max(eps, 2.0**-10)  # TF32 GEMMs round to 10 mantissa bits
    return eps


class GradABFT:
    """Checksums of the weight gradients of every eligible linear, embedding and RMSNorm layer,
    predicted during backward and checked before the DP reduction (see the module docstring)."""

    def __init__(self, model: nn.Module, lam: float = LAMBDA) -> None:
        uses = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        self.layers: dict[int, tuple[str, nn.Module]] = {
            id(m): (name, m) for name, m in model.named_modules() if _eligible(m) and uses[id(m.weight)] == 1
        }
        self.lam = lam
        # id(layer) -> this step's backward passes: (predicted checksum, its error scale, terms per sum)
        self._expected: dict[int, list[tuple[torch.Tensor, Any, int]]] = {}
        self._input_norms: tuple[Any, Any] = (None, None)  # the last linear input and ||X_:j||_2
        self._handles = [m.register_forward_hook(self._on_forward) for _, m in self.layers.values()]
        self.error: IntegrityError | None = None
        self.worst = 0.0  # the last verified step's largest |difference| / tolerance (<= 1 passes)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def discard(self) -> None:
        """Forget the passes recorded since the last `verify` (a probe's, training.integrity.swap)."""
        self._expected = {}
        self._input_norms = (None, None)

    def _on_forward(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        # Every tensor the checks compute on is detached: they record no graph (no no_grad context).
        x = (output if isinstance(module, RMSNorm) else inputs[0]).detach()  # the norm's check reads Y
        norms = None
        if isinstance(module, nn.Linear):  # ||X_:j||_2 now, while X is in cache; projections of one
            if self._input_norms[0] is not inputs[0]:  # input (q, k, v; w1, w3) share it
                self._input_norms = (inputs[0], self._column_norms(x.reshape(-1, x.shape[-1])))
            norms = self._input_norms[1]
        output.register_hook(functools.partial(self._accumulate, module, x, input_norms=norms))

    def _column_norms(self, x2: torch.Tensor) -> torch.Tensor:
        """||X_:j||_2 of a (T, in) input: one fused reduction on CUDA; on CPU squares and a column sum
        (measured in bench.sdc's setting: as fast as vector_norm(dim=0), which is ~10x slower on one
        thread, and faster than a GEMV of the squares, which wins on one thread only)."""
        if x2.is_cuda:
            return _vnorm(x2, dim=0, dtype=torch.float32)
        return (x2 * x2).sum(dim=0).sqrt_()

    @staticmethod
    def _column_sums(m: torch.Tensor) -> torch.Tensor:
        """1^T M of a (T, k) matrix. torch's column reduction (measured on one CPU thread, torch 2.13:
        0.6-0.8x the time of a GEMV with a ones vector for the gradients' shapes)."""
        return m.sum(dim=0)

    def _accumulate(self, module: nn.Module, x: torch.Tensor, dy: torch.Tensor, input_norms: Any = None
                    ) -> None:
        """This backward pass's predicted checksum; only the passes over dY and X run here, the
        small per-column arithmetic waits for `verify`. `x` is detached."""
        dy2 = dy.detach().reshape(-1, dy.shape[-1])  # (T, out)
        passes = self._expected.setdefault(id(module), [])
        if isinstance(module, nn.Embedding):  # G[v] = sum of dY over the tokens v: 1^T G = 1^T dY
            predicted = self._column_sums(dy2)
            scale = self._column_sums(dy2.abs())
            passes.append((predicted, scale, 2 * dy2.shape[0]))  # <= T nonzero rows
            return
        x2 = x.reshape(-1, x.shape[-1])  # (T, in)
        if isinstance(module, RMSNorm):  # w_j G_j = sum_t dY_tj Y_tj, Y = n w the norm's output
            prod = dy2 * x2  # (T, dim)
            predicted = self._column_sums(prod)
            passes.append((predicted, self._column_sums(prod.abs_()), dy2.shape[0] + 4))  # 4 products rounded
            return
        # Linear: 1^T G = (dY 1)^T X (Huang & Abraham's column checksum), (in,)
        if dy2.element_size() < 4:  # bf16: dY 1 in fp32, as a sum of two bf16 vectors (one matvec dtype)
            rows = dy2.sum(dim=1, dtype=torch.float32)
            high = rows.to(x2.dtype)
            predicted = (high @ x2).float() + ((rows - high.float()).to(x2.dtype) @ x2).float()
        else:
            rows = dy2.sum(dim=1)  # dY 1, (T,)
            predicted = rows @ x2
        passes.append((predicted, (_vnorm(dy2), rows, input_norms), x2.shape[0] + dy2.shape[1]))

    @torch.no_grad()
    def verify(self, step: int, rank: int) -> IntegrityError | None:
        """Compare each layer's local weight gradient with its prediction (then forget the step).
        One host sync for all layers; the per-column detail only when a layer fails."""
        self.error = None
        expected, self._expected = self._expected, {}
        self._input_norms = (None, None)
        compared = self.compare(expected)
        if compared is None:
            self.worst = 0.0
            return None
        names, sizes, diff, tol = compared
        self.worst = float((diff / tol).max())  # NaN propagates: non-finite is bad
        if self.worst <= 1.0:
            return None
        for name, d, t in zip(names, diff.split(sizes), tol.split(sizes), strict=True):
            bad = ~(d <= t)  # NaN compares False
            if bool(bad.any()):
                col = int(bad.nonzero()[0])
                self.error = IntegrityError("grad_abft", step, [rank], {
                    "layer": name, "column": col, "difference": json_number(float(d[col])),
                    "tolerance": float(t[col]), "columns_off": int(bad.sum()),
                    "where": "weight gradient vs its Huang-Abraham checksum, before the reduction"})
                return self.error
        return None

    def compare(self, expected: dict[int, list[tuple[torch.Tensor, Any, int]]]
                ) -> tuple[list[str], list[int], torch.Tensor, torch.Tensor] | None:
        """(layer names, columns per layer, |1^T G - prediction|, tolerance) over every checked column,
        or None when no layer has a gradient. Batched: one read of each gradient (its column sums),
        the linear layers' error scales in a few vector ops over all layers, one multiply for every
        tolerance (per layer only the column sum, and the bf16 rounding term)."""
        layers = [(*self.layers[key], passes) for key, passes in expected.items()
                  if self.layers[key][1].weight.grad is not None]
        if not layers:
            return None
        scales = iter(_pass_scales([p[1] for _, _, passes in layers for p in passes]))
        names, gots, preds, parts, coefs = [], [], [], [], []
        for name, module, passes in layers:
            g = module.weight.grad.detach()
            names.append(name)
            predicted = passes[0][0] if len(passes) == 1 else torch.stack([p[0] for p in passes]).sum(dim=0)
            scale = next(scales)
            for _ in passes[1:]:  # micro-batches: the errors of each pass add
                scale = scale + next(scales)
            n = sum(p[2] for p in passes) + len(passes)  # roundings on a term's path, both sides
            factor = min(n, self.lam * math.sqrt(n))
            if isinstance(module, RMSNorm):
                got, part, coef = module.weight.detach() * g, scale, _eps(g) * factor  # w_j G_j
            elif isinstance(module, nn.Linear) and g.element_size() < 4:
                # bf16: the GEMM and our sums accumulate in fp32; what rounds to bf16 is each element
                # of G (random over a column: ||G_:j||_2) and the two halves of the prediction.
                got, coef = g.sum(dim=0, dtype=torch.float32), 1.0
                part = 2.0**-23 * factor * scale + _eps(g) * self.lam * (
                    _vnorm(g, dim=0, dtype=torch.float32) + predicted.abs())
            else:
                got, part, coef = self._column_sums(g), scale, _eps(g) * factor  # 1^T G
            gots.append(got)
            preds.append(predicted)
            parts.append(part)
            coefs.append(coef)
        sizes = [v.numel() for v in gots]
        tol = torch.cat(parts)
        tol = tol * _repeat(torch.tensor(coefs, dtype=tol.dtype).to(tol.device), sizes) + 1e-30
        diff = (torch.cat(gots) - torch.cat(preds)).abs()
        return names, sizes, diff, tol


def _repeat(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """values[i] repeated sizes[i] times (the output size given: no device sync on CUDA)."""
    counts = torch.tensor(sizes, device=values.device)
    return torch.repeat_interleave(values, counts, output_size=sum(sizes))


def _pass_scales(parts: list[Any]) -> list[torch.Tensor]:
    """Each pass's error scale per column: given (embeddings, norms), or (||dY||_F + ||dY 1||_2)
    ||X_:j||_2 for a linear, batched per dtype: one stack of the passes' ||dY||_F, one fused norm of
    their dY 1, one product with their ||X_:j||_2."""
    out: list[Any] = list(parts)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            groups.setdefault((p[1].dtype, p[1].device), []).append(i)
    for idx in groups.values():
        fro = torch.stack([parts[i][0] for i in idx])
        rows = torch.stack(torch._foreach_norm([parts[i][1] for i in idx]))  # noqa: SLF001 - one kernel
        norms = [parts[i][2] for i in idx]
        sizes = [v.numel() for v in norms]
        scaled = torch.cat(norms) * _repeat((fro + rows).to(norms[0].dtype), sizes)
        for i, v in zip(idx, scaled.split(sizes), strict=True):
            out[i] = v
    return out


