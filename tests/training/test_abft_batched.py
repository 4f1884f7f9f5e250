"""The batched ABFT comparison (training.integrity.abft.GradABFT.compare) against the per-layer
formulation it replaced: on the same backward passes, the same tolerance per column (up to the
rounding of the reordered products) and the same flagged column when one gradient element is
corrupted; and the gradient audit's local norm read from the gathered table equals the local one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from training.integrity.abft import GradABFT, _eps
from training.integrity.injection import flip_bit
from training.model.transformer import RMSNorm

_vnorm = torch.linalg.vector_norm


def _reference(abft: GradABFT, expected: dict[int, list[Any]]
               ) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """(names, |difference|, tolerance) computed layer by layer, as `verify` did before batching."""
    names, diffs, tols = [], [], []
    for key, passes in expected.items():
        name, module = abft.layers[key]
        if module.weight.grad is None:
            continue
        g = module.weight.grad.detach()
        scales = []
        for p in passes:
            if isinstance(p[1], torch.Tensor):
                scales.append(p[1])
            else:
                fro, rows, input_norms = p[1]
                scales.append(input_norms * (fro + _vnorm(rows)))
        scale = scales[0]
        for s in scales[1:]:
            scale = scale + s
        predicted = passes[0][0] if len(passes) == 1 else torch.stack([p[0] for p in passes]).sum(dim=0)
        n = sum(p[2] for p in passes) + len(passes)
        factor = min(n, abft.lam * math.sqrt(n))
        if isinstance(module, RMSNorm):
            got, tol = module.weight.detach() * g, _eps(g) * factor * scale
        elif isinstance(module, nn.Linear) and g.element_size() < 4:
            got = g.sum(dim=0, dtype=torch.float32)
            tol = 2.0**-23 * factor * scale + _eps(g) * abft.lam * (
                _vnorm(g, dim=0, dtype=torch.float32) + predicted.abs())
        else:
            got = torch.ones(g.shape[0], dtype=g.dtype) @ g  # a GEMV, as before
            tol = _eps(g) * factor * scale
        names.append(name)
        diffs.append((got - predicted).abs())
        tols.append(tol + 1e-30)
    return names, torch.cat(diffs), torch.cat(tols)


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Embedding(40, 16), RMSNorm(16, 1e-5), nn.Linear(16, 48, bias=False), nn.GELU(),
                         nn.Linear(48, 40)).to(dtype)


def _backward(model: nn.Module, micro_batches: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(micro_batches):
        tokens = torch.randint(0, 40, (3, 10), generator=g)
        logits = model(tokens).float().flatten(0, 1)
        torch.nn.functional.cross_entropy(logits, tokens.flatten()).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_batched_tolerance_matches_the_per_layer_one(dtype: torch.dtype, micro_batches: int) -> None:
    model = _model(dtype)
    abft = GradABFT(model)
    _backward(model, micro_batches, seed=micro_batches)
    expected = {k: list(v) for k, v in abft._expected.items()}  # noqa: SLF001 - the step's passes
    names, sizes, diff, tol = abft.compare(expected)
    ref_names, ref_diff, ref_tol = _reference(abft, expected)
    assert names == ref_names == ["4", "2", "1", "0"]  # in backward order
    assert sizes == [48, 16, 16, 16]
    # bf16 norm and embedding layers: the per-layer tolerance was rounded to bf16, the batched one is
    # kept in fp32 (the concatenation with the linear layers' fp32 tolerances)
    torch.testing.assert_close(tol, ref_tol, rtol=2.0**-8 if dtype == torch.bfloat16 else 1e-5, atol=0.0)
    # the differences agree up to the column sums' rounding (a reduction instead of a GEMV)
    torch.testing.assert_close(diff, ref_diff, rtol=0.0, atol=float(ref_tol.min()))
    assert bool((diff <= tol).all()) and bool((ref_diff <= ref_tol).all())


@pytest.mark.parametrize(("layer", "bit"), [(0, 31), (1, 30), (2, 31), (2, 24), (4, 31), (4, 27)])
def test_batched_check_flags_the_corrupted_column_as_the_per_layer_one(layer: int, bit: int) -> None:
    model = _model(torch.float32)
    abft = GradABFT(model)
    _backward(model, 2, seed=7)
    grad = model[layer].weight.grad
    index = int(grad.abs().argmax())
    flip_bit(grad, index, bit)
    expected = {k: list(v) for k, v in abft._expected.items()}  # noqa: SLF001
    names, sizes, diff, tol = abft.compare(expected)
    _, ref_diff, ref_tol = _reference(abft, expected)
    flagged, ref_flagged = ~(diff <= tol), ~(ref_diff <= ref_tol)
    assert torch.equal(flagged, ref_flagged)
    offset = sum(sizes[: names.index(str(layer))])
    column = index % grad.shape[-1] if grad.dim() > 1 else index
    assert flagged.nonzero().flatten().tolist() == [offset + column]
    abft._expected = expected  # noqa: SLF001 - verify names the same layer and column
    error = abft.verify(5, rank=1)
    assert error is not None and error.evidence["layer"] == str(layer) and error.evidence["column"] == column


def test_compare_without_gradients_is_none_and_verify_passes() -> None:
    model = _model(torch.float32)
    abft = GradABFT(model)
    _backward(model, 1, seed=1)
    model.zero_grad(set_to_none=True)
    assert abft.compare(dict(abft._expected)) is None  # noqa: SLF001
    assert abft.verify(0, rank=0) is None and abft.worst == 0.0


def test_checks_record_no_graph_and_leave_gradients_unchanged() -> None:
    model = _model(torch.float32)
    abft = GradABFT(model)
    _backward(model, 2, seed=4)
    for passes in abft._expected.values():  # noqa: SLF001
        for predicted, scale, _ in passes:
            assert not predicted.requires_grad
            assert all(not t.requires_grad for t in (scale if isinstance(scale, tuple) else (scale,)))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert abft.verify(0, rank=0) is None
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
