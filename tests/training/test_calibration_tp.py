"""Calibration's TP cost is timed inside the engine's TP-sharded Transformer against a model of the
shapes one rank computes (training/calibration/engine.py, `measure_tp_linear`), and it counts the
collectives the way the planner charges them (service/planner/costmodel.py)."""

from __future__ import annotations

from typing import Any

from tests.distributed import run_ranks
from training.config.arithmetic import block_matrices
from training.config.spec import ModelSpec

SPECS = (ModelSpec(layers=2, hidden=128, heads=8, kv_heads=2, vocab=512, seq_len=64),
         ModelSpec(layers=3, hidden=64, heads=4, vocab=256, seq_len=32, activation="gelu"))


def _shapes_rank(rank: int, world: int) -> list[dict[str, Any]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from training.calibration.engine import _local_shapes, _sharded_linears, measure_tp_linear
    from training.model.transformer import Transformer
    from training.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for spec in SPECS:
        torch.manual_seed(0)
        sharded = Transformer(spec)
        apply_tensor_parallel(sharded, mesh, sequence_parallel=False)
        local = _local_shapes(Transformer(spec), world)
        out.append({
            "sharded": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
                        for n, p in sharded.named_parameters()},
            "local": {n: tuple(p.shape) for n, p in local.named_parameters()},
            "dtensors": sum(isinstance(p, DTensor) for p in sharded.parameters()),
            "linears": _sharded_linears(local),
        })
    out.append({"measured": measure_tp_linear(world, 1, tokens=(64,))})
    return out


def test_tp_cost_is_timed_against_one_ranks_own_shapes_and_counts_the_planners_collectives() -> None:
    results = run_ranks(2, _shapes_rank, timeout_s=300)
    for rank_result in results:
        for spec, r in zip(SPECS, rank_result[:-1], strict=True):
            # The baseline does exactly the arithmetic of one TP rank: every parameter's local shard.
            assert r["local"] == r["sharded"], spec
            assert r["dtensors"] > 0
            # One collective per sharded linear per layer, plus the embedding and the head: the count
            # the cost model multiplies the measured cost by.
            assert r["linears"] == block_matrices(spec) * spec.layers + 2
        [(nbytes, seconds)] = rank_result[-1]["measured"]
        assert nbytes == 64 * 128 * 4 and seconds >= 0.0
