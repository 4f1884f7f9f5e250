"""Mixture-of-experts feed-forward with expert parallelism (EP) over an `ep` process group.

    moe = MoELayer(hidden=512, expert_ffn=1024, num_experts=8, top_k=2, capacity_factor=1.25,
                   ep_group=ep_group, seed=1234)
    y, aux = moe(x)                 # x, y: (..., hidden); aux: scalar, add coef * aux to the loss
    moe.last_stats.dropped_group    # assignments dropped by the capacity rule in this step

Routing (per token): softmax over `num_experts` router logits, keep the top-k; with k > 1 the k
weights are renormalised to sum to 1 (Mixtral), with k = 1 the raw probability is kept so the
router still gets a gradient from the output (Switch Transformer).

Capacity and dropping: each expert accepts at most
    capacity = ceil(capacity_factor * T_group * top_k / num_experts)
assignments per step (Switch Transformer eq. 3; GShard), where T_group counts the tokens of the
whole EP group. Assignments are served first come, first served in a global order: EP rank, then
token index, then top-k slot. An assignment beyond an expert's capacity is dropped: it contributes
0 to that token's output (the block's residual connection carries the token through). Because the
order is global, the dropped set, outputs and gradients do not depend on the EP degree: EP=1, 2, 4
over the same tokens give the same numbers. `capacity_factor=None` never drops.

Auxiliary load-balancing loss (Switch Transformer eq. 4): aux = E * sum_i f_i * P_i, with f_i the
fraction of the group's assignments routed to expert i (before dropping, no gradient) and P_i the
mean router probability of expert i over the group's tokens. Each rank returns
    aux_r = E * ep * sum_i f_i * (sum of its own tokens' p_i) / T_group,
so mean_r aux_r == aux exactly and averaging gradients over the group (what DP does) gives the
gradient of aux. A balanced router has aux = 1.

Expert parallel: the experts are split into `ep` contiguous shards (rank p holds experts
[p*E/ep, (p+1)*E/ep)). Each expert's weights are drawn from a generator seeded by (seed, tensor,
expert index), so any EP degree holds the same weights and a rank only materialises its shard.
Dispatch and combine are `all_to_all_single` with unbalanced split sizes; the split sizes follow
from the per-expert loads, which every rank already has from the one all-gather the capacity rule
needs (so there is no separate count all-to-all).

Inside the model (training/model/transformer.py, training/parallel/parallelize.py) a layer is built
with all experts
(on the meta device), then `shard_experts(ep_mesh)` keeps this rank's E/ep of them as DTensors
Shard(0) over the EP mesh, so checkpoints, digests and gradient clipping see the full expert
tensors; `reset_parameters(seed)` draws only the experts a rank holds. The forward uses the local
shards (`_local`), so plain and DTensor parameters behave the same.

Gradients with EP x DP (see docs/context_parallel.md, "MoE"): the router (dense) is replicated on
every rank: average its gradient over the whole data-parallel world (dp x cp) as usual. Each expert
shard lives on one rank per EP group and already receives the gradient of every token its group
sent it; sum it over the expert-data-parallel group (ranks with the same EP index) and divide by
the dp x cp world size: `reduce_expert_grads(moe, edp_group, dp_world)` (training.parallel.expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from training.parallel.wrapping import copy_full_into

ACTIVATIONS = ("swiglu", "gelu")


class MoEError(ValueError):
    """A MoE configuration that cannot be built; the message names the field and what is allowed."""


@dataclass
class MoEStats:
    """What the last forward did (plain Python numbers, safe to log)."""

    tokens: int  # tokens on this rank
    assignments: int  # tokens * top_k on this rank
    dropped: int  # of this rank's assignments, dropped by the capacity rule
    dropped_group: int  # the same over the EP group
    capacity: int  # per expert, over the EP group (-1: no capacity limit)
    expert_load: list[int] = field(default_factory=list)  # group assignments per expert, before dropping
    aux_loss: float = 0.0  # this rank's aux_r


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Assignments one expert accepts per step; -1 when unlimited. Switch Transformer eq. 3."""
    if capacity_factor is None:
        return -1
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def expert_parallel_groups(ranks: list[int], ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Split the data-parallel ranks (dp x cp, in layout order) into EP groups and expert-DP groups.

    EP groups are runs of `ep` consecutive ranks (they exchange tokens every layer, so they should
    be close in the network); the expert-DP group of a rank holds the ranks with the same EP index
    in every EP group (they hold the same experts and reduce their gradients).
    """
    if ep < 1 or len(ranks) % ep != 0:
        raise MoEError(f"layout.ep ({ep}) must be >= 1 and divide the {len(ranks)} data-parallel ranks")
    ep_groups = [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
    edp_groups = [[g[j] for g in ep_groups] for j in range(ep)]
    return ep_groups, edp_groups


def _expert_generator(seed: int, which: int, expert: int) -> torch.Generator:
    """A generator per (seed, weight tensor, expert index), independent of the EP layout."""
    mixed = (seed * 0x9E3779B97F4A7C15 + which * 0xBF58476D1CE4E5B9 + expert * 0x94D049BB133111EB) % 2**63
    return torch.Generator().manual_seed(mixed)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with unbalanced splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


class MoELayer(nn.Module):
    """Top-k routed experts replacing the dense FFN of a block. See the module docstring."""

    def __init__(
        self,
        hidden: int,
        expert_ffn: int,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
        ep_group: ProcessGroup | None = None,
        activation: str = "swiglu",
        *,
        seed: int = 0,
        init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise MoEError(f"model.activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise MoEError(f"model.top_k ({top_k}) must be between 1 and model.num_experts ({num_experts})")
        if capacity_factor is not None and capacity_factor <= 0:
            raise MoEError(f"model.capacity_factor must be > 0 or None (no dropping), got {capacity_factor}")
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if num_experts % self.ep != 0:
            raise MoEError(f"model.num_experts ({num_experts}) must be divisible by layout.ep ({self.ep})")
        self.hidden, self.expert_ffn, self.num_experts, self.top_k = hidden, expert_ffn, num_experts, top_k
        self.capacity_factor, self.activation = capacity_factor, activation
        self.local_experts = num_experts // self.ep
        self.first_expert = self.ep_rank * self.local_experts
        self.last_stats: MoEStats | None = None

        # Every expert tensor is drawn from its own generator, seeded from (seed, tensor, expert):
        # any EP degree holds the same weights, and a rank only materialises its own shard (the
        # full expert set of a DeepSeek-V3-sized layer would not fit in host memory). Init
        # N(0, init_std) (GPT-2). On the meta device nothing is drawn: `reset_parameters` later.
        self.seed, self.init_std = seed, init_std
        kw = {"device": device, "dtype": dtype}

        def empty(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(self.local_experts, *shape, **kw))  # type: ignore[arg-type]

        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)  # type: ignore[arg-type]
        self.w_gate = empty(hidden, expert_ffn) if activation == "swiglu" else None  # (E_local, h, ffn)
        self.w_up = empty(hidden, expert_ffn)  # (E_local, hidden, ffn)
        self.w_down = empty(expert_ffn, hidden)  # (E_local, ffn, hidden)
        if not self.router.weight.is_meta:
            self.reset_parameters()

    # ---- initialisation and expert parallel over a device mesh -----------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Draw the router and this rank's experts from (seed, tensor, expert) generators.

        Works for plain shards and for DTensor parameters (experts Shard(0) over an EP mesh, or
        any FSDP sharding): each rank draws only the experts (or router rows) it holds.
        """
        from torch.distributed.tensor import DTensor

        self.seed = self.seed if seed is None else seed
        gen = torch.Generator().manual_seed(self.seed)
        router = torch.randn(self.num_experts, self.hidden, generator=gen, device="cpu") * self.init_std
        copy_full_into(self.router.weight, router)
        for which, p in ((0, self.w_gate), (1, self.w_up), (2, self.w_down)):
            if p is None:
                continue
            if isinstance(p, DTensor):
                first, count = _dim0_slice(p)
            else:
                first, count = self.first_expert, self.local_experts
            shape = tuple(p.shape[1:])
            draws = [torch.randn(*shape, generator=_expert_generator(self.seed, which, e), device="cpu")
                     for e in range(first, first + count)]
            local = _local(p)
            if draws:
                local.copy_((torch.stack(draws) * self.init_std).to(dtype=local.dtype, device=local.device))

    def shard_experts(self, ep_mesh: DeviceMesh) -> None:
        """Expert parallel over a 1-D device mesh: keep this rank's E/ep experts, as DTensors
        Shard(0) over `ep_mesh` (so checkpoints, digests and gradient clipping see the full
        expert tensors). Call before the weights are materialised, or on a full (ep = 1) layer."""
        from torch.distributed.tensor import DTensor, Shard

        if self.ep != 1:
            raise MoEError("shard_experts needs a layer built with ep_group=None (all experts local)")
        ep = ep_mesh.size()
        if self.num_experts % ep != 0:
            raise MoEError(f"model.num_experts ({self.num_experts}) must be divisible by layout.ep ({ep})")
        self.ep_group = ep_mesh.get_group()
        self.ep, self.ep_rank = ep, ep_mesh.get_local_rank()
        self.local_experts = self.num_experts // ep
        self.first_expert = self.ep_rank * self.local_experts
        for name in ("w_gate", "w_up", "w_down"):
            p = getattr(self, name)
            if p is None:
                continue
            local = p.detach().narrow(0, self.first_expert, self.local_experts).clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(sharded, requires_grad=p.requires_grad))

    # ---- parameter groups --------------------------------------------------------------------------
    def expert_parameters(self) -> list[nn.Parameter]:
        """Sharded over EP: reduce over the expert-DP group (`reduce_expert_grads`), not the DP world."""
        return [p for p in (self.w_gate, self.w_up, self.w_down) if p is not None]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Replicated on every rank (the router): ordinary data-parallel gradient averaging."""
        return list(self.router.parameters())

    # ---- forward --------------------------------------------------------------------------------------
    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run local expert e on the next counts[e] rows of x (rows grouped by expert)."""
        outs = []
        w_up, w_down = _local(self.w_up), _local(self.w_down)
        w_gate = _local(self.w_gate) if self.w_gate is not None else None
        for e, rows in enumerate(torch.split(x, counts)):
            h = rows @ w_up[e]  # (n_e, ffn)
            if w_gate is not None:
                h = F.silu(rows @ w_gate[e]) * h  # SwiGLU (Shazeer 2020)
            else:
                h = F.gelu(h)
            outs.append(h @ w_down[e])  # (n_e, hidden); every expert runs, so all get a grad
        return torch.cat(outs)

    def _group_loads(self, tokens: int, load: torch.Tensor) -> torch.Tensor:
        """(ep, 1 + E): every EP rank's token count and per-expert assignment count."""
        mine = torch.cat([torch.tensor([tokens], dtype=torch.long, device=load.device), load])
        if self.ep == 1:
            return mine.unsqueeze(0)
        gathered = [torch.empty_like(mine) for _ in range(self.ep)]
        dist.all_gather(gathered, mine, group=self.ep_group)
        return torch.stack(gathered)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.size(-1) != self.hidden:
            raise MoEError(f"MoE input last dim must be hidden ({self.hidden}), got {tuple(x.shape)}")
        shape = x.shape
        xt = x.reshape(-1, self.hidden)  # (T, h)
        tokens, k, n_exp, ep, n_local = xt.size(0), self.top_k, self.num_experts, self.ep, self.local_experts

        probs = torch.softmax(self.router(xt).float(), dim=-1)  # (T, E), fp32 routing
        top_w, top_e = probs.topk(k, dim=-1)  # (T, k)
        if k > 1:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        flat_e = top_e.reshape(-1)  # (T*k,) token-major: the first-come-first-served order
        load = torch.bincount(flat_e, minlength=n_exp)  # (E,)

        loads = self._group_loads(tokens, load)  # (ep, 1 + E)
        group_tokens = int(loads[:, 0].sum())
        group_load = loads[:, 1:].sum(0)  # (E,)
        capacity = expert_capacity(group_tokens, k, n_exp, self.capacity_factor)

        # Position of each assignment in its expert's queue: earlier EP ranks first, then token order.
        order = torch.argsort(flat_e, stable=True)
        start = torch.cumsum(load, 0) - load
        rank_in_expert = torch.empty_like(flat_e)
        rank_in_expert[order] = torch.arange(flat_e.numel(), device=flat_e.device) - start[flat_e[order]]
        queue_pos = rank_in_expert + loads[: self.ep_rank, 1:].sum(0)[flat_e]
        keep = queue_pos < capacity if capacity >= 0 else torch.ones_like(flat_e, dtype=torch.bool)

        # Aux loss, Switch Transformer eq. 4, in the per-rank form described in the module docstring.
        frac = group_load.float() / max(group_tokens * k, 1)  # f_i, no gradient
        aux = n_exp * ep * (frac * probs.sum(0)).sum() / max(group_tokens, 1)

        # Dispatch: kept assignments sorted by expert (hence by destination rank), token order within.
        kept = keep.nonzero().squeeze(1)
        kept = kept[torch.argsort(flat_e[kept], stable=True)]  # (N_send,) assignment ids
        send_x = xt[kept // k]  # (N_send, h)
        # kept[s, e] = how many of rank s's assignments to expert e survive the capacity rule.
        before = torch.cumsum(loads[:, 1:], 0) - loads[:, 1:]
        kept_counts = loads[:, 1:] if capacity < 0 else (capacity - before).clamp(min=0).minimum(loads[:, 1:])
        if ep > 1:
            send_splits = kept_counts[self.ep_rank].view(ep, n_local).sum(1).tolist()
            from_src = kept_counts[:, self.first_expert : self.first_expert + n_local]  # (ep, E_local)
            recv_splits = from_src.sum(1).tolist()
            # Received rows come grouped by source rank, then by expert within each source.
            recv_x = _AllToAll.apply(send_x, recv_splits, send_splits, self.ep_group)
            local_ids = torch.arange(n_local, device=xt.device).repeat(ep)
            recv_e = torch.repeat_interleave(local_ids, from_src.flatten())
            by_expert = torch.argsort(recv_e, stable=True)
            unsort = torch.empty_like(by_expert)
            unsort[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
            out = self._experts(recv_x[by_expert], from_src.sum(0).tolist())[unsort]
            back = _AllToAll.apply(out, send_splits, recv_splits, self.ep_group)  # (N_send, h), send order
        else:
            back = self._experts(send_x, kept_counts[0].tolist())

        # Combine: weighted sum of each token's surviving expert outputs; dropped ones add nothing.
        weights = top_w.reshape(-1)[kept].to(back.dtype).unsqueeze(1)
        y = xt.new_zeros(xt.shape).index_add(0, kept // k, back * weights)

        dropped = int(flat_e.numel() - kept.numel())
        assert kept.numel() == int(kept_counts[self.ep_rank].sum()), "local and group drop rules disagree"
        self.last_stats = MoEStats(
            tokens=tokens,
            assignments=int(flat_e.numel()),
            dropped=dropped,
            dropped_group=int(group_load.sum() - kept_counts.sum()),
            capacity=capacity,
            expert_load=[int(c) for c in group_load.tolist()],
            aux_loss=float(aux.detach()),
        )
        return y.view(shape), aux  # aux stays fp32


# ---- DTensor helpers ---------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a parameter: a DTensor's local shard (differentiable), else itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _dim0_slice(p: torch.Tensor) -> tuple[int, int]:
    """(first index, count) along dim 0 of the global tensor that this rank's DTensor shard holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)  # type: ignore[attr-defined]
    return int(offset[0]), int(shape[0])

