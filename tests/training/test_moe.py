"""MoE with expert parallelism (training/model/moe.py) against the same MoE on one rank.

One spawn of 4 gloo ranks runs every distributed case: EP=4 over the world, and EP=2 in two EP
groups {0,1}, {2,3} composed with DP (expert-DP groups {0,2}, {1,3}).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks
from training.model.moe import (
    MoEError,
    MoELayer,
    expert_capacity,
    expert_parallel_groups,
)
from training.parallel.expert import reduce_expert_grads

HIDDEN, FFN, EXPERTS = 16, 24, 8
TOL = 1e-5  # relative to the largest reference entry
Results = list[dict[str, dict[str, float]]]

# name -> (ep, top_k, capacity_factor, activation, uneven token counts per rank)
CASES: dict[str, tuple[int, int, float | None, str, bool]] = {
    "ep4_top2_dropping_uneven": (4, 2, 0.5, "swiglu", True),
    "ep4_top1_gelu": (4, 1, 1.0, "gelu", False),
    "ep2xdp2_top2_dropping": (2, 2, 0.75, "swiglu", False),
    "ep2xdp2_top2_no_capacity": (2, 2, None, "swiglu", False),
}


def _batch(seed: int, world: int, uneven: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [6 + 3 * r if uneven else 8 for r in range(world)]
    xs = [torch.randn(n, HIDDEN, generator=g) for n in sizes]
    ws = [torch.randn(n, HIDDEN, generator=g) for n in sizes]  # upstream gradient: loss = sum(y * w)
    return xs, ws


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (gradients here are ~1e-3, so an absolute bound would be weak)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _run_case(
    rank: int,
    world: int,
    seed: int,
    ep: int,
    k: int,
    cf: float | None,
    act: str,
    uneven: bool,
    ep_groups: dict[int, Any],
    edp_groups: dict[int, Any],
) -> dict[str, float]:
    xs, ws = _batch(seed, world, uneven)
    group_id, ep_rank = rank // ep, rank % ep
    members = list(range(group_id * ep, (group_id + 1) * ep))
    layer = MoELayer(HIDDEN, FFN, EXPERTS, k, cf, ep_group=ep_groups[ep][group_id], activation=act, seed=seed)
    x = xs[rank].clone().requires_grad_()
    y, aux = layer(x)
    # Each rank's loss; the global loss is their mean over the dp world (DP averages the gradients).
    ((y * ws[rank]).sum() + aux).backward()
    stats = layer.last_stats
    assert stats is not None
    for p in layer.dense_parameters():  # the replicated router: ordinary DP averaging
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad.div_(world)
    reduce_expert_grads(layer, edp_groups.get(ep, {}).get(ep_rank), dp_world=world)

    # Reference: one rank, no EP, each EP group's tokens concatenated in rank order.
    ref = MoELayer(HIDDEN, FFN, EXPERTS, k, cf, ep_group=None, activation=act, seed=seed)
    ref_loss = torch.zeros(())
    for g in range(world // ep):
        rows = range(g * ep, (g + 1) * ep)
        xr = torch.cat([xs[r] for r in rows]).requires_grad_()
        yr, aux_r = ref(xr)
        # sum over the group's ranks of aux_r equals ep * aux (see training/model/moe.py)
        ref_loss = ref_loss + (yr * torch.cat([ws[r] for r in rows])).sum() + ep * aux_r
        if g == group_id:
            offset = sum(xs[r].size(0) for r in members if r < rank)
            mine = slice(offset, offset + xs[rank].size(0))
            ref_y, ref_x, ref_aux = yr[mine], xr, aux_r
            ref_stats = ref.last_stats
            assert ref_stats is not None
    ref_loss.div(world).backward()

    aux_mean = aux.detach().clone()
    dist.all_reduce(aux_mean, group=ep_groups[ep][group_id])
    dropped_sum = torch.tensor(stats.dropped)
    dist.all_reduce(dropped_sum, group=ep_groups[ep][group_id])
    shard = slice(ep_rank * (EXPERTS // ep), (ep_rank + 1) * (EXPERTS // ep))
    errs = {
        "y": _max_err(y.detach(), ref_y.detach()),
        "x_grad": _max_err(x.grad / world, ref_x.grad[mine]),  # activations are not DP-averaged
        "aux": abs(aux_mean.item() / ep - ref_aux.item()) / abs(ref_aux.item()),
        "router_grad": _max_err(layer.router.weight.grad, ref.router.weight.grad),
        "init": max(
            _max_err(mine_p.detach(), full.detach()[shard])
            for mine_p, full in zip(layer.expert_parameters(), ref.expert_parameters(), strict=True)
        ),
    }
    for name, mine_p, full in zip(
        ("w_gate", "w_up", "w_down")[-len(layer.expert_parameters()) :],
        layer.expert_parameters(),
        ref.expert_parameters(),
        strict=True,
    ):
        errs[f"{name}_grad"] = _max_err(mine_p.grad, full.grad[shard])
    errs |= {
        "dropped_group": float(stats.dropped_group),
        "ref_dropped": float(ref_stats.dropped),
        "dropped_local_sum": float(dropped_sum.item()),
        "capacity": float(stats.capacity),
        "ref_capacity": float(ref_stats.capacity),
        "load_matches": float(stats.expert_load == ref_stats.expert_load),
        "grad_scale": min(p.grad.abs().max().item() for p in layer.parameters()),
    }
    return errs


def _moe_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    ep2_groups, edp2_groups = expert_parallel_groups(list(range(world)), 2)
    ep_groups = {
        4: {0: dist.group.WORLD},
        2: {i: dist.new_group(ranks) for i, ranks in enumerate(ep2_groups)},
    }
    edp_groups = {2: {j: dist.new_group(ranks) for j, ranks in enumerate(edp2_groups)}}
    return {
        name: _run_case(rank, world, 10 + i, ep, k, cf, act, uneven, ep_groups, edp_groups)
        for i, (name, (ep, k, cf, act, uneven)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def moe_results() -> Results:
    return run_ranks(4, _moe_worker)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_single_rank(moe_results: Results, name: str) -> None:
    _, _, cf, _, _ = CASES[name]
    for rank, per_rank in enumerate(moe_results):
        r = per_rank[name]
        for what in ("y", "x_grad", "aux", "router_grad", "init", "w_up_grad", "w_down_grad"):
            assert r[what] < TOL, f"rank {rank} {name}: rel. error of {what} vs one rank: {r[what]:.3g}"
        if "w_gate_grad" in r:
            assert r["w_gate_grad"] < TOL, f"rank {rank} {name}: w_gate grad off by {r['w_gate_grad']:.3g}"
        assert r["grad_scale"] > 0, f"rank {rank} {name}: a parameter got an all-zero gradient"
        assert r["dropped_group"] == r["ref_dropped"] == r["dropped_local_sum"], r
        assert r["capacity"] == r["ref_capacity"], r
        assert r["load_matches"] == 1.0, r
        if cf is not None and cf < 1:
            assert r["dropped_group"] > 0, f"{name}: capacity factor {cf} should have dropped tokens"
        if cf is None:
            assert r["dropped_group"] == 0 and r["capacity"] == -1


# ---- single-process checks -------------------------------------------------------------------------


def test_capacity_and_dropping_order() -> None:
    assert expert_capacity(tokens=10, top_k=2, num_experts=4, capacity_factor=1.25) == 7  # ceil(6.25)
    assert expert_capacity(tokens=10, top_k=2, num_experts=4, capacity_factor=None) == -1
    layer = MoELayer(8, 8, 2, 1, capacity_factor=0.5, seed=0)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 1.0  # tokens with x[:, 0] > 0 pick expert 0, others expert 1
    x = torch.zeros(8, 8)
    x[:, 0] = 1.0  # every token wants expert 0; capacity = ceil(0.5 * 8 / 2) = 2
    x[:, 1] = torch.arange(8.0)
    y, _ = layer(x)
    stats = layer.last_stats
    assert stats is not None and stats.capacity == 2 and stats.dropped == 6
    served = (y.abs().sum(1) > 0).tolist()
    assert served == [True, True] + [False] * 6  # first come, first served; dropped tokens output 0


def test_aux_loss_is_one_for_a_uniform_router_and_larger_when_skewed() -> None:
    layer = MoELayer(8, 8, 4, 1, None, seed=0)
    with torch.no_grad():
        layer.router.weight.zero_()
    _, aux = layer(torch.randn(16, 8))
    assert aux.item() == pytest.approx(1.0)
    with torch.no_grad():
        layer.router.weight[0].fill_(5.0)
    _, skewed = layer(torch.ones(16, 8))
    assert skewed.item() > 3.5  # everything on expert 0: f_0 = 1, P_0 ~ 1 -> aux ~ E


def test_bad_configuration_is_rejected() -> None:
    with pytest.raises(MoEError, match="top_k"):
        MoELayer(8, 8, 4, 5, 1.0)
    with pytest.raises(MoEError, match="capacity_factor"):
        MoELayer(8, 8, 4, 2, 0.0)
    with pytest.raises(MoEError, match="activation"):
        MoELayer(8, 8, 4, 2, 1.0, activation="relu")
    with pytest.raises(MoEError, match="layout.ep"):
        expert_parallel_groups([0, 1, 2], 2)
    assert expert_parallel_groups([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


class _TinyMoELM(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.moe = MoELayer(hidden, 2 * hidden, num_experts=4, top_k=2, capacity_factor=1.25, seed=7)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        moe_out, aux = self.moe(self.norm(h))
        return self.head(h + moe_out), aux  # dropped tokens ride the residual


def test_small_moe_model_trains() -> None:
    torch.manual_seed(0)
    vocab = 24
    model = _TinyMoELM(vocab, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(vocab, generator=g)  # task: next token = perm[token]
    losses = []
    for _ in range(40):
        ids = torch.randint(0, vocab, (8, 16), generator=g)
        logits, aux = model(ids)
        loss = F.cross_entropy(logits.view(-1, vocab), perm[ids].view(-1))
        opt.zero_grad()
        (loss + 0.01 * aux).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses
    assert model.moe.last_stats is not None and model.moe.last_stats.assignments == 8 * 16 * 2
