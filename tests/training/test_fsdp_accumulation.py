"""Gradient accumulation under FSDP2 (ZeRO-2/3) keeps gradients sharded between micro-batches: each
micro-batch is reduce-scattered as it finishes (what the planner's memory model charges); under HSDP
only the all-reduce across replicate groups waits for the last micro-batch (training/parallel/optim.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed import run_ranks

MICRO = 2


def _rank(rank: int, world: int, reshard: bool, replicate: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from training.config.spec import ModelSpec
    from training.model.transformer import Transformer
    from training.parallel.fsdp import apply_fsdp
    from training.parallel.optim import microbatch_context

    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=8)
    if replicate > 1:
        names = ("dp_replicate", "dp_shard")
        mesh = init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (world,))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Transformer(spec)
        m.init_weights(0)
        models.append(m)
    sharded, plain = models
    apply_fsdp(sharded, mesh, reshard_after_forward=reshard, device_type="cpu")
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, spec.vocab, (MICRO, world, 2, spec.seq_len), generator=gen)  # [micro][rank]
    after_first: dict[str, Any] = {}
    for i in range(MICRO):
        with microbatch_context(sharded, is_last=i == MICRO - 1):
            sharded(data[i, rank]).float().square().mean().backward()
        if i == 0:
            grads = [p.grad for p in sharded.parameters()]
            after_first = {
                "set": sum(g is not None for g in grads), "params": len(grads),
                "sharded": all(isinstance(g, DTensor) and g.to_local().numel() == p.to_local().numel()
                               for g, p in zip(grads, sharded.parameters(), strict=True) if g is not None),
            }  # fmt: skip
    # One process over every rank's micro-batches; FSDP2 averages over the data-parallel ranks.
    for i in range(MICRO):
        for r in range(world):
            (plain(data[i, r]).float().square().mean() / world).backward()
    ref = dict(plain.named_parameters())
    worst = max((p.grad.full_tensor() - ref[n].grad).abs().max().item()
                for n, p in sharded.named_parameters())
    return {**after_first, "worst": worst}


@pytest.mark.parametrize(("reshard", "replicate"), [(True, 1), (False, 1), (True, 2)],
                         ids=["zero3", "zero2", "hsdp-zero3"])
def test_fsdp_accumulates_sharded_gradients_and_defers_only_the_replica_all_reduce(reshard: bool,
                                                                                   replicate: int) -> None:
    results = run_ranks(2, _rank, (reshard, replicate), timeout_s=300)
    for r in results:
        if replicate == 1:
            # Reduce-scattered after the first micro-batch already: every gradient is a shard.
            assert r["set"] == r["params"] and r["sharded"]
        else:
            # HSDP: the partial sums wait inside FSDP2 for the replica all-reduce of the last micro-batch.
            assert r["set"] == 0
        assert r["worst"] < 1e-5
