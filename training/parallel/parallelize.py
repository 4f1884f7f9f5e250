"""Apply a Layout to one model (or one pipeline stage), in one fixed, visible order.

    tensor parallel (+ sequence parallel)  ->  context parallel  ->  expert parallel
        ->  activation recomputation  ->  FSDP (ZeRO-2/3)  ->  materialise weights
        ->  torch.compile (opt-in, in place: training.parallel.compile)
        ->  DDP (ZeRO-0/1; with expert parallel, DDP for the dense weights + expert reduction)

Each technique lives in its own module (tensor, context, expert, recompute, fsdp, ddp; the optimizer,
clipping and micro-batching in optim); this one only fixes the order. Pipeline parallelism wraps it
(training.parallel.pipeline calls `parallelize` once per stage). Weights are materialised after FSDP
has sharded them (so no rank ever holds a full copy of a model built on the meta device) and before
DDP, which broadcasts rank 0's weights at construction and so needs them to exist. Without FSDP, TP
parameters then get a gradient hook that puts each gradient in its parameter's layout
(`align_grad_placements`), because DDP and ZeRO-1 reduce local shards.

Context parallel (cp > 1) splits each sequence over the `cp` mesh dimension (ring attention,
training/parallel/context.py); CP ranks hold the same weights, so every data-parallel reduction
runs over dp x cp (the flattened "dp_cp" mesh, torchtitan's dp_shard_cp), and
ParallelDims.replica_group() is dp x cp.

Expert parallel (ep > 1, MoE models) splits each MoE layer's experts over runs of `ep` dp_cp ranks
(the "ep" mesh; training.parallel.expert). ZeRO-2/3 (FSDP) with ep > 1 is refused: FSDP would have
to shard the experts over edp and the dense weights over dp x cp, two FSDP meshes in one block.

Gradient synchronisation over the data-parallel group (dp x cp), by ZeRO stage:
  0  training.parallel.ddp.DDP (dp_impl "lattice") or torch DDP (dp_impl "torch")
  1  the same gradient all-reduce, then training.parallel.zero.ShardedOptimizer(AdamW)
  2  fully_shard(reshard_after_forward=False) per block, then the root
  3  fully_shard(reshard_after_forward=True) per block, then the root (False under the
     split-backward pipeline schedules, see training.parallel.fsdp.SPLIT_BACKWARD_SCHEDULES)
  With layout.dp_replicate > 1 (ZeRO-2/3), FSDP2 gets the 2-D (dp_replicate, dp_shard) mesh: HSDP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.validate import check_layout_for_model
from training.model.transformer import Transformer
from training.parallel.compile import apply_compile
from training.parallel.ddp import apply_data_parallel
from training.parallel.expert import ExpertDataParallel, apply_expert_parallel
from training.parallel.fsdp import apply_fsdp, materialize, reshard_after_forward
from training.parallel.mesh import ParallelDims
from training.parallel.precision import MasterWeights, is_mixed
from training.parallel.recompute import apply_recompute
from training.parallel.tensor import align_grad_placements, apply_tensor_parallel


def parallelize(model: Transformer, layout: Layout, mesh: DeviceMesh | ParallelDims, run_cfg: RunConfig,
                device: torch.device | None = None) -> nn.Module:
    """TP -> CP -> EP -> recompute -> FSDP -> materialise -> DDP. Returns the module to run forward on.

    `mesh` is the trainer's ParallelDims (or a bare 4-D (pp, dp, cp, tp) mesh, whose derived meshes
    are then built here: collective when the layout has cp > 1 or ep > 1, every rank must call it).
    """
    check_layout_for_model(model.spec, layout)
    dims = mesh if isinstance(mesh, ParallelDims) else ParallelDims.from_mesh(layout, mesh)
    root = dims.mesh
    device = device or torch.device(root.device_type)
    if layout.tp > 1:
        apply_tensor_parallel(model, root["tp"], layout.sequence_parallel)
    if layout.cp > 1:
        model.set_context_parallel(dims.group("cp"))
    if layout.ep > 1:
        apply_expert_parallel(model, dims.submesh("ep"))
    # The train loop divides each micro-batch's loss by their number; a pipeline schedule
    # (scale_grads) divides the gradients itself. The aux loss's gradient must match either way.
    coef = model.spec.aux_loss_coef
    model.set_aux_loss_scale(coef / layout.num_microbatches if layout.pp == 1 else coef)
    apply_recompute(model, layout.recompute)
    replicas = layout.dp * layout.cp  # ranks holding the same dense weights
    if layout.zero_stage >= 2 and replicas > 1:
        apply_fsdp(model, dims.submesh("fsdp"), reshard_after_forward(layout.zero_stage, layout.schedule),
                   device_type=device.type, precision=run_cfg.precision)
    materialize(model, run_cfg.seed, device)
    if is_mixed(run_cfg.precision) and not isinstance(model, FSDPModule):
        # bf16 parameters before DDP builds its (then bf16) buckets; fp32 masters kept aside.
        model.master_weights = MasterWeights(list(model.parameters()))  # type: ignore[assignment]
    if layout.tp > 1 and not isinstance(model, FSDPModule):
        # After materialising: to_empty() replaces meta parameters, dropping their hooks.
        align_grad_placements(model)
    # In place: parameter names stay canonical (fingerprints, checkpoints). Not with TP (eager).
    apply_compile(model, run_cfg.compile, run_cfg.compile_backend, layout.tp)
    if layout.ep > 1:
        return ExpertDataParallel(model, dims.group("dp_cp"), dims.group("edp"), replicas)
    if layout.zero_stage < 2 and replicas > 1:
        return apply_data_parallel(model, layout, dims.group("dp_cp"), run_cfg.dp_impl)
    return model
