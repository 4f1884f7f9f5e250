"""ZeRO-1 (ShardedOptimizer) on real gloo ranks against non-sharded AdamW in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks
from training.parallel.ddp import DDP
from training.parallel.zero import ShardedOptimizer, partition_by_size

WORLD = 2
GLOBAL_BATCH = 8
STEPS = 4
TOL = 1e-5
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def make_model() -> nn.Module:
    # Eight equal 16x16 layers (balanced exactly over 2 ranks) plus small odd-sized ones.
    layers: list[nn.Module] = [nn.Linear(6, 16)]
    for _ in range(8):
        layers += [nn.Tanh(), nn.Linear(16, 16, bias=False)]
    layers += [nn.Tanh(), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def groups_of(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:5]}, {"params": params[5:], "lr": 3e-3}]


def loss_of(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(b[0]), b[1])


def reference(steps: int) -> list[torch.Tensor]:
    """Plain AdamW, one process, the whole global batch; the second group is added later, as below."""
    torch.manual_seed(0)
    model = make_model()
    g0, g1 = groups_of(model)
    opt = torch.optim.AdamW(g0["params"], **ADAMW)
    opt.add_param_group(g1)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch(step)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_sharded(
    model: nn.Module, opt: ShardedOptimizer, rank: int, world: int, steps: range, group=None
) -> None:
    ddp = DDP(model, bucket_size_mb=None, process_group=group)
    n = GLOBAL_BATCH // world
    for step in steps:
        opt.zero_grad(set_to_none=True)
        x, y = batch(step)
        loss_of(ddp, (x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n])).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    ddp.remove_hooks()


def max_diff(model: nn.Module, ref: list[torch.Tensor]) -> float:
    return max((p.detach() - r).abs().max().item() for p, r in zip(model.parameters(), ref, strict=True))


def _zero_worker(rank: int, world: int, shard_dir: str) -> dict[str, object]:
    out: dict[str, object] = {}
    singles = [dist.new_group([r]) for r in range(world)]  # every rank must create every group
    ref = reference(STEPS)

    torch.manual_seed(0)
    model = make_model()
    g0, g1 = groups_of(model)
    # A 2 KiB broadcast bucket: each owner's parameters travel in several chunks.
    opt = ShardedOptimizer(g0["params"], torch.optim.AdamW, broadcast_bucket_mb=2 / 1024, **ADAMW)
    opt.add_param_group(g1)
    run_sharded(model, opt, rank, world, range(STEPS // 2))

    # Sharded state dict: only owned params, keyed by stable index; round trip into a fresh optimizer.
    sd = opt.state_dict()
    out["sd_keys"] = sorted(sd["state"])
    out["owned_idx"] = sorted(opt.param_index(p) for p in opt.owned_params())
    out["owners"] = [opt.owner_of(p) for p in model.parameters()]
    out["inner_params"] = sum(len(g["params"]) for g in opt.inner.param_groups)
    out["loads"] = opt.param_counts_per_rank()
    out["group_lrs"] = [g["lr"] for g in opt.param_groups]
    out["broadcast_chunks"] = sum(len(chunks) for _, chunks in opt.broadcast_plan())
    torch.manual_seed(0)
    model2 = make_model()
    model2.load_state_dict(model.state_dict())
    opt2 = ShardedOptimizer(groups_of(model2), torch.optim.AdamW, **ADAMW)
    opt2.load_state_dict(copy.deepcopy(sd))  # like torch.optim, loading aliases the given tensors

    # The union of all shards loads into a one-rank ShardedOptimizer (another world size).
    # (through files: object collectives need numpy, which this environment does not have)
    torch.save(sd, f"{shard_dir}/shard-{rank}.pt")
    dist.barrier()
    shards = [torch.load(f"{shard_dir}/shard-{r}.pt") for r in range(world)]
    union = {**sd, "state": {k: v for s in shards for k, v in s["state"].items()}}
    model3 = make_model()
    model3.load_state_dict(model.state_dict())
    opt3 = ShardedOptimizer(groups_of(model3), torch.optim.AdamW, process_group=singles[rank], **ADAMW)
    opt3.load_state_dict(union)

    full_bytes = 8 * sum(p.numel() for p in model.parameters())  # AdamW: exp_avg + exp_avg_sq, fp32
    out["state_fraction"] = state_bytes(opt.inner) / full_bytes

    run_sharded(model, opt, rank, world, range(STEPS // 2, STEPS))
    run_sharded(model2, opt2, rank, world, range(STEPS // 2, STEPS))
    run_sharded(model3, opt3, 0, 1, range(STEPS // 2, STEPS), group=singles[rank])
    out["diff"] = max_diff(model, ref)
    pairs = zip(model.parameters(), model2.parameters(), strict=True)
    out["resumed_equal"] = all(torch.equal(p, q) for p, q in pairs)
    out["resharded_diff"] = max_diff(model3, ref)

    opt.zero_grad(set_to_none=True)
    out["all_grads_cleared"] = all(p.grad is None for p in model.parameters())
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_ranks(WORLD, _zero_worker, (str(tmp_path_factory.mktemp("zero-shards")),))


def test_matches_plain_adamw(results: list[dict[str, object]]) -> None:
    for r in results:
        assert r["diff"] < TOL, r["diff"]
        assert r["group_lrs"] == [1e-2, 3e-3]  # add_param_group kept the second group's own lr
        assert r["broadcast_chunks"] > 4


def test_partition_is_disjoint_complete_and_balanced(results: list[dict[str, object]]) -> None:
    owners = results[0]["owners"]
    assert all(r["owners"] == owners for r in results)  # every rank computes the same assignment
    assert sorted(set(owners)) == list(range(WORLD))
    all_idx = sorted(i for r in results for i in r["owned_idx"])
    assert all_idx == list(range(len(owners)))
    for rank, r in enumerate(results):
        assert r["inner_params"] == owners.count(rank)  # the inner optimizer holds only owned params
    loads = results[0]["loads"]
    assert max(loads) / (sum(loads) / WORLD) < 1.05  # within 5% of a perfect split


def test_state_dict_round_trip_and_reshard(results: list[dict[str, object]]) -> None:
    for r in results:
        assert r["sd_keys"] == r["owned_idx"]
        assert r["resumed_equal"]
        assert r["resharded_diff"] < TOL


def test_optimizer_state_is_one_over_world(results: list[dict[str, object]]) -> None:
    for r in results:
        assert abs(r["state_fraction"] - 1 / WORLD) < 0.05 / WORLD, r["state_fraction"]
        assert r["all_grads_cleared"]


def test_partition_by_size_greedy_largest_first() -> None:
    assert partition_by_size([10, 9, 8, 1], 2) == [0, 1, 1, 0]
    sizes = [4096] * 24 + [64] * 20 + [1] * 7
    for world in (2, 3, 4, 8):
        owners = partition_by_size(sizes, world)
        loads = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(sizes)
        assert abs(max(loads) / (sum(sizes) / world) - 1) < 0.05
    loads = [0, 0]
    assert partition_by_size([5], 2, loads) == [0] and partition_by_size([5], 2, loads) == [1]
    with pytest.raises(ValueError, match="world_size"):
        partition_by_size([1], 0)
