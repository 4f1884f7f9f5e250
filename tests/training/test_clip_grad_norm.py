"""The global gradient-norm clip (training/parallel/optim.py) over DTensor gradients: the norm of
every gradient in one reduction per (mesh, placements) group, equal to the norm of the full
gradients, on 2 real gloo ranks (FSDP2 shards, and TP's mix of sharded and replicated weights)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed import run_ranks


def _rank(rank: int, world: int, kind: str) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    from training.config.spec import ModelSpec
    from training.model.transformer import Transformer
    from training.parallel.fsdp import apply_fsdp
    from training.parallel.optim import clip_grad_norm
    from training.parallel.tensor import apply_tensor_parallel

    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=8)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Transformer(spec)
    model.init_weights(0)
    if kind == "fsdp":  # each rank its own batch; TP ranks share one
        apply_fsdp(model, mesh, reshard_after_forward=True, device_type="cpu")
    else:
        apply_tensor_parallel(model, mesh, sequence_parallel=False)
    gen = torch.Generator().manual_seed(rank if kind == "fsdp" else 0)
    tokens = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    model(tokens).float().square().mean().backward()

    def full_grads() -> list[torch.Tensor]:
        return [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]

    full = [g.clone() for g in full_grads()]  # a replicated gradient's full_tensor is the gradient itself
    expected = torch.sqrt(sum(torch.linalg.vector_norm(g.double()) ** 2 for g in full))
    groups = {(g.device_mesh, tuple(g.placements)) for g in (p.grad for p in model.parameters())
              if isinstance(g, DTensor)}
    max_norm = float(expected) / 4  # the clip is active: every gradient scaled by ~1/4
    with CommDebugMode() as comm:
        total = clip_grad_norm([model], max_norm, None)
    scale = max_norm / (total + 1e-6)
    worst = max((c.double() - g.double() * scale).abs().max().item()
                for c, g in zip(full_grads(), full, strict=True))
    return {"total": total, "expected": float(expected), "collectives": comm.get_total_counts(),
            "groups": len(groups), "params": len(full), "worst": worst}


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_clip_reduces_each_dtensor_group_once_and_matches_the_full_gradient_norm(kind: str) -> None:
    for r in run_ranks(2, _rank, (kind,), timeout_s=300):
        assert r["total"] == pytest.approx(r["expected"], rel=1e-5)
        assert r["worst"] < 1e-6
        # One reduction per group of gradients sharing a mesh and placements, not one per parameter
        # (FSDP2: every gradient is Shard(0), one group of 21 parameters).
        assert r["groups"] < r["params"]
        assert r["collectives"] <= r["groups"]
        if kind == "fsdp":
            assert r["groups"] == 1 and r["collectives"] == 1
