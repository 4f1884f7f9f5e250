"""Expert parallel for MoE models: shard each MoE layer's experts over the `ep` mesh, and the data
parallel wrapper that averages dense gradients with DDP and reduces expert gradients over the
expert-data-parallel group (`reduce_expert_grads`).

Dense weights (attention, norms, router, embeddings) are averaged over dp x cp by DDP as usual; the
experts are left out of it and summed over the expert-data-parallel group ("edp": same experts),
then divided by dp x cp. ZeRO-1 shards the optimizer state over the replica group (edp with EP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from training.model.moe import MoELayer
from training.model.transformer import Transformer
from training.parallel.ddp import DDP
from training.parallel.wrapping import local_tensor


def apply_expert_parallel(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E/ep experts of every MoE layer, as DTensors Shard(0) over the ep mesh."""
    for moe in model.moe_layers():
        moe.shard_experts(ep_mesh)


class _DenseView(nn.Module):
    """The model as the dense data-parallel wrapper sees it: every parameter but the experts."""

    def __init__(self, model: Transformer, excluded: list[nn.Parameter]) -> None:
        super().__init__()
        object.__setattr__(self, "model", model)  # not registered: parameters() is filtered below
        self._excluded = {id(p) for p in excluded}

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return (p for p in self.model.parameters(recurse) if id(p) not in self._excluded)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.model.buffers(recurse)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.model(*args, **kwargs)


class ExpertDataParallel(nn.Module):
    """Data parallel for a model with expert parallel layers (ZeRO-0/1).

    Dense weights: training.parallel.ddp.DDP over dp x cp (overlapped, bucketed). Expert shards:
    after the last backward of the step, `reduce_expert_grads` sums them over the expert-DP group
    and divides by dp x cp, which is the gradient of the loss averaged over every rank (each
    shard already received the gradients of all the tokens its EP group routed to it).
    Same interface as DDP: `.module`, `no_sync()`, `finish_gradient_synchronization()`.
    """

    def __init__(self, model: Transformer, dense_group: dist.ProcessGroup, edp_group: dist.ProcessGroup,
                 dp_world: int) -> None:
        super().__init__()
        self.module = model
        self.edp_group, self.dp_world = edp_group, dp_world
        experts = [p for moe in model.moe_layers() for p in moe.expert_parameters()]
        dense = None
        if dist.get_world_size(dense_group) > 1:
            dense = DDP(_DenseView(model, experts), process_group=dense_group)
        object.__setattr__(self, "dense", dense)  # not a submodule: parameters are the model's

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.dense is None:
            yield
        else:
            with self.dense.no_sync():
                yield

    def finish_gradient_synchronization(self) -> None:
        if self.dense is not None:
            self.dense.finish_gradient_synchronization()
        for moe in self.module.moe_layers():
            reduce_expert_grads(moe, self.edp_group, self.dp_world)


def reduce_expert_grads(layer: MoELayer, edp_group: ProcessGroup | None, dp_world: int) -> None:
    """Expert gradient for a loss averaged over dp_world (= dp x cp) ranks: sum over the expert-DP
    group (ranks with the same EP index), divide by dp_world. The router is not touched (it is a
    dense parameter: average it over the whole DP world with the rest of the model)."""
    for p in layer.expert_parameters():
        if p.grad is None:
            continue
        grad = local_tensor(p.grad)
        if edp_group is not None and dist.get_world_size(edp_group) > 1:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=edp_group)
        grad.div_(dp_world)
