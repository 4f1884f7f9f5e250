"""Tensor parallel (+ sequence parallel) for the Transformer: the Megatron layout of every block, and
the gradient hook that keeps each TP gradient in its parameter's placement for the DP code."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from training.model.transformer import Transformer


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Megatron layout: QKV and MLP-up column-wise, attention-out and MLP-down row-wise.

    With sequence parallel the residual stream between blocks is sharded on the sequence
    dimension (B, T/tp, C); norms run on their shard and the attention / MLP inputs are
    all-gathered (Korthikanti et al. 2022, section 4.2.2). Layout follows torchtitan.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        # Logits are all-gathered so the loss is an ordinary cross-entropy on every TP rank.
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate(), use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.spec.tied_embeddings and model.output is not None and model.tok_embeddings is not None:
        # Both are Shard(0) over the vocabulary; re-tie the two DTensor parameters.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            )
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        parallelize_module(block, tp_mesh, plan)


def align_grad_placements(model: nn.Module) -> None:
    """Make each DTensor parameter's gradient arrive with the parameter's own placements.

    Autograd leaves some TP gradients in another layout: under sequence parallel a norm weight's
    gradient is Partial (each rank summed over its own tokens) and the embedding's is Replicate.
    Optimizers on DTensors cope, but the DP code works on local shards (`to_local()`), so the
    gradient is redistributed before it is accumulated: Partial -> Replicate is the all-reduce
    over the TP group that Megatron-LM does for sequence-parallel norms; Replicate -> Shard is a
    local slice.
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            mesh, placements = p.device_mesh, tuple(p.placements)

            def to_param_layout(grad: torch.Tensor, mesh: DeviceMesh = mesh,
                                placements: tuple = placements) -> torch.Tensor:
                if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
                    return grad.redistribute(mesh, placements)
                return grad

            p.register_hook(to_param_layout)
