"""Algorithm-based fault tolerance (ABFT) for the weight gradients, opt-in (`integrity.abft`):
Huang & Abraham, "Algorithm-Based Fault Tolerance for Matrix Operations", IEEE Trans. Computers,
1984 — a matrix product carries a checksum that a cheap product predicts. Linear layers get the
column checksum below; an embedding's gradient (the output gradients summed per token id) has the
column checksum 1^T G = 1^T dY; an RMSNorm's weight gradient sum_t dY_t * n_t is a vector as cheap
to recompute as its checksum would be, so it is recomputed whole.

A linear layer's weight gradient is G = dY^T X (dY: (T, out), X: (T, in), T tokens). Its column
checksum is predicted by a matrix-vector product, O(T (in + out)) against the GEMM's O(T in out):

    1^T G = (dY 1)^T X        (the sum over the output rows of G, one value per input column)

computed from the layer's input and output gradient as backward produces them, and compared with
the gradient the rank is about to reduce (`p.grad` before the DP reduction, summed over its rows).
Everything is float32 (float64 copies of the activations cost more than the check is worth), so
the honest difference per column is bounded by the rounding of the GEMM (length T), of dY 1
(length out), of the matrix-vector product (length T) and of the row sum of G (length out):
(2T + 2 out) u (|dY| 1)^T |X| (Higham 2002, eq. 3.5: a dot product of length n errs by at most
n u sum|a_t b_t|), plus one u per accumulated micro-batch; eps = 2u counts each T and out once
with the same margin. Any corruption of G between
the GEMM and the reduction larger than that — a flipped sign, mantissa or exponent bit of one
element — breaks the identity, whatever its size relative to the other ranks' gradients, which
the norm checks (training.integrity.gradient) cannot see.

Scope: `nn.Linear`, `nn.Embedding` (dense, no padding row) and RMSNorm weights used by no other
module (a tied weight gets other gradients too), not DTensor (TP/FSDP) weights, and pipeline
parallel off (the schedule interleaves micro-batches; the hooks pair each layer's last input with
its output gradient). It keeps a reference to each layer's input until its backward (autograd
keeps them anyway, except under activation recompute).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.integrity.detectors import IntegrityError
from training.model.transformer import RMSNorm


def _eligible(m: nn.Module) -> bool:
    if isinstance(m, nn.Embedding) and (m.padding_idx is not None or m.sparse):
        return False  # the padding row's gradient is zeroed; sparse gradients have no dense sum
    return isinstance(m, nn.Linear | nn.Embedding | RMSNorm) and not isinstance(m.weight, DTensor)


class GradABFT:
    """Checksums of the weight gradients of every eligible linear, embedding and RMSNorm layer,
    predicted during backward and checked before the DP reduction (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        uses = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
        self.layers: dict[int, tuple[str, nn.Module]] = {
            id(m): (name, m) for name, m in model.named_modules() if _eligible(m) and uses[id(m.weight)] == 1
        }
        # id(layer) -> [predicted checksum, its rounding bound, terms summed, backward passes]
        self._expected: dict[int, list[Any]] = {}
        self._abs_input: tuple[Any, Any] = (None, None)  # the last linear input and its |X|
        self._handles = [m.register_forward_hook(self._on_forward) for _, m in self.layers.values()]
        self.error: IntegrityError | None = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_forward(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        x = inputs[0]

        def on_output_grad(dy: torch.Tensor) -> None:
            self._accumulate(module, x, dy)

        output.register_hook(on_output_grad)

    def _predict(self, module: nn.Module, x: torch.Tensor, dy2: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(predicted checksum, bound on its rounding / u, terms) of this backward's weight gradient."""
        if isinstance(module, nn.Embedding):  # G[v] = sum of dY over the tokens v: 1^T G = 1^T dY
            return dy2.sum(dim=0), dy2.abs().sum(dim=0), dy2.shape[0]
        x2 = x.detach().reshape(-1, x.shape[-1])  # (T, in)
        if isinstance(module, RMSNorm):  # G = sum_t dY_t * n_t: a vector, recomputed whole (cheap)
            x32 = x2.float()  # the forward's own arithmetic, so n is bit-identical to autograd's
            n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)).type_as(x2)
            prod = dy2 * n
            return prod.sum(dim=0), prod.abs().sum(dim=0), dy2.shape[0]
        # Linear: 1^T G = (dY 1)^T X (Huang & Abraham's column checksum), (in,). Projections of one
        # input (q, k, v; w1, w3) run backward one after the other: |X| is computed once for them.
        if self._abs_input[0] is not x:
            self._abs_input = (x, x2.abs())
        return dy2.sum(dim=1) @ x2, dy2.abs().sum(dim=1) @ self._abs_input[1], x2.shape[0] + dy2.shape[1]

    @torch.no_grad()
    def _accumulate(self, module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
        dy2 = dy.detach().reshape(-1, dy.shape[-1])  # (T, out)
        predicted, bound, terms = self._predict(module, x, dy2)
        acc = self._expected.get(id(module))
        if acc is None:
            self._expected[id(module)] = [predicted, bound, terms, 1]
        else:
            acc[0] += predicted
            acc[1] += bound
            acc[2] += terms
            acc[3] += 1

    @torch.no_grad()
    def verify(self, step: int, rank: int) -> IntegrityError | None:
        """Compare each layer's local weight gradient with its prediction (then forget the step)."""
        self.error = None
        expected, self._expected = self._expected, {}
        self._abs_input = (None, None)
        for key, (predicted, bound, tokens, passes) in expected.items():
            name, module = self.layers[key]
            grad = module.weight.grad
            if grad is None:
                continue
            g = grad.detach()
            got = g if g.dim() == 1 else g.sum(dim=0)  # 1^T G (the norm's G itself)
            eps = torch.finfo(grad.dtype).eps
            if grad.is_cuda and torch.backends.cuda.matmul.allow_tf32:
                eps = max(eps, 2.0**-10)  # TF32 GEMMs round to 10 mantissa bits
            tol = (tokens + (g.shape[0] if g.dim() > 1 else 0) + passes + 2) * eps * bound + 1e-30
            diff = (got - predicted).abs()
            bad = ~(diff <= tol)  # NaN compares False: non-finite is bad
            if bool(bad.any()):
                col = int(bad.nonzero()[0])
                self.error = IntegrityError("grad_abft", step, [rank], {
                    "layer": name, "column": col, "difference": _num(float(diff[col])),
                    "tolerance": float(tol[col]), "columns_off": int(bad.sum()),
                    "where": "weight gradient vs its Huang-Abraham checksum, before the reduction"})
                return self.error
        return None


def _num(v: float) -> float | str:
    return v if v == v and abs(v) != float("inf") else str(v)
