"""Apply a Layout to one model (or one pipeline stage), in one fixed, visible order.

    tensor parallel (+ sequence parallel)  ->  context parallel  ->  expert parallel
        ->  activation recomputation  ->  FSDP (ZeRO-2/3)  ->  materialise weights
        ->  DDP (ZeRO-0/1; with expert parallel, DDP for the dense weights + expert reduction)

Pipeline parallelism wraps this (training.parallel.pipeline calls `parallelize` once per stage).
Weights are materialised after FSDP has sharded them (so no rank ever holds a full copy of a
model built on the meta device) and before DDP, which broadcasts rank 0's weights at
construction and so needs them to exist. Without FSDP, TP parameters then get a gradient hook
that puts each gradient in its parameter's layout (`align_grad_placements`), because DDP and
ZeRO-1 reduce local shards.

Recomputation modes (Layout.recompute):
  none       keep every activation.
  selective  recompute the attention branch (norm, QKV, RoPE, attention, output projection) of
             every block in backward and keep the MLP's activations: attention's activations grow
             with the sequence and are cheap to recompute relative to the MLP (Korthikanti et al.
             2022, section 4). Implemented with torch.utils.checkpoint inside the block.
  full       recompute each whole block from its input (one saved tensor per layer).
Recomputation is a flag on each block rather than a checkpoint_wrapper, so parameter names
stay canonical.

Context parallel (cp > 1) splits each sequence over the `cp` mesh dimension (ring attention,
training/parallel/context.py); CP ranks hold the same weights, so every data-parallel reduction
below runs over dp x cp (the flattened "dp_cp" mesh, torchtitan's dp_shard_cp), and
ParallelDims.replica_group() is dp x cp.

Expert parallel (ep > 1, MoE models) splits each MoE layer's experts over runs of `ep` dp_cp
ranks (the "ep" mesh); the expert tensors become DTensors Shard(0) over it, so checkpoints,
digests and the gradient-norm clip see full tensors. Dense weights (attention, norms, router,
embeddings) are averaged over dp x cp by DDP as usual; the experts are left out of it and summed
over the expert-data-parallel group ("edp": same experts), then divided by dp x cp
(`reduce_expert_grads`), by `ExpertDataParallel`. ZeRO-1 shards the optimizer state over the
replica group (edp with EP). ZeRO-2/3 (FSDP) with ep > 1 is refused: FSDP would have to shard the
experts over edp and the dense weights over dp x cp, two FSDP meshes in one block.

Gradient synchronisation over the data-parallel group (dp x cp), by ZeRO stage:
  0  training.parallel.ddp.DDP (dp_impl "lattice") or torch DDP (dp_impl "torch")
  1  the same gradient all-reduce, then training.parallel.zero.ShardedOptimizer(AdamW)
  2  fully_shard(reshard_after_forward=False) per block, then the root
  3  fully_shard(reshard_after_forward=True) per block, then the root (False under the
     split-backward pipeline schedules, see SPLIT_BACKWARD_SCHEDULES)
With pipeline parallelism each stage module is wrapped the same way. A stage runs backward
once per micro-batch (the zero-bubble schedules split it into input and weight parts), so the
train loop runs the whole schedule inside DDP's `no_sync()` and reduces once after the flush
(`finish_gradient_synchronization` launches every bucket from the final gradients), as
Megatron-LM does; FSDP stages are driven by the pipeline stage itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from training.config.layout import Layout, LayoutError
from training.config.run import RunConfig
from training.config.validate import check_layout_for_model
from training.model.moe import reduce_expert_grads
from training.model.transformer import Transformer
from training.parallel.mesh import ParallelDims

# Pipeline schedules that split backward into an input pass and a later weight pass. With them,
# FSDP2's reshard_after_forward=True gives wrong weight gradients in torch 2.13 (the stage's
# weight pass runs after the next micro-batch's forward has resharded the parameters; measured:
# parameters off by ~1e-2 after two steps on gloo), so ZeRO-3 stages keep their parameters
# gathered from forward to the end of the step there (torchtitan never reshards after forward
# under PP either); they are still sharded between steps.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")

# ---- validation ------------------------------------------------------------------------
# ---- tensor parallel -------------------------------------------------------------------
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


# ---- expert parallel ---------------------------------------------------------------------------
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
        from training.parallel.ddp import DDP

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


# ---- activation recomputation ------------------------------------------------------------
def apply_recompute(model: Transformer, mode: str) -> None:
    for block in model.layers.values():
        block.recompute = mode


# ---- FSDP (ZeRO-2 / ZeRO-3) ---------------------------------------------------------------
def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, reshard_after_forward: bool,
               device_type: str) -> None:
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if device_type == "cuda" else MixedPrecisionPolicy())
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # The root keeps embeddings / norm / head; it is needed right after the last block in
    # backward and first in forward, so it is never resharded after forward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    # Explicit prefetch of the next block (forward) and the previous one (backward).
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])


# ---- materialisation -----------------------------------------------------------------------
def materialize(model: Transformer, seed: int, device: torch.device) -> None:
    """Allocate a meta-built model on `device` and initialise it by name (no-op if not on meta)."""
    if not any(p.is_meta for p in model.parameters()) and not model.rope_cos.is_meta:
        return
    model.to_empty(device=device)
    model.init_weights(seed)


# ---- data parallel ---------------------------------------------------------------------------
def apply_data_parallel(model: nn.Module, layout: Layout, dp_group: dist.ProcessGroup,
                        dp_impl: str) -> nn.Module:
    if dp_impl == "torch":
        if layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
            raise LayoutError(
                "train.dp_impl 'torch' (torch DDP) needs tp = 1, pp = 1 and ep = 1; "
                "use dp_impl 'lattice' or zero_stage 2/3"
            )
        return torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    from training.parallel.ddp import DDP

    return DDP(model, process_group=dp_group)


def parallelize(model: Transformer, layout: Layout, mesh: DeviceMesh | ParallelDims, run_cfg: RunConfig,
                device: torch.device | None = None) -> nn.Module:
    """TP -> CP -> EP -> recompute -> FSDP -> materialise -> DDP. Returns the module to run forward on.

    `mesh` is the 4-D (pp, dp, cp, tp) mesh or its ParallelDims (collective when the layout has
    cp > 1 or ep > 1 and the derived meshes do not exist yet: every rank must call it).
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
        reshard = layout.zero_stage == 3 and layout.schedule not in SPLIT_BACKWARD_SCHEDULES
        apply_fsdp(model, dims.submesh("dp_cp"), reshard_after_forward=reshard, device_type=device.type)
    materialize(model, run_cfg.seed, device)
    if layout.tp > 1 and not isinstance(model, FSDPModule):
        # After materialising: to_empty() replaces meta parameters, dropping their hooks.
        align_grad_placements(model)
    if layout.ep > 1:
        return ExpertDataParallel(model, dims.group("dp_cp"), dims.group("edp"), replicas)
    if layout.zero_stage < 2 and replicas > 1:
        return apply_data_parallel(model, layout, dims.group("dp_cp"), run_cfg.dp_impl)
    return model


def unwrap(module: nn.Module) -> Transformer:
    """The Transformer inside a DDP wrapper (ours or torch's); FSDP modules are their own."""
    inner = getattr(module, "module", module)
    assert isinstance(inner, Transformer), type(inner)
    return inner


# ---- gradient accumulation and synchronisation -----------------------------------------------
@contextlib.contextmanager
def microbatch_context(module: nn.Module, is_last: bool) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on every micro-batch but the last."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(is_last)
        yield
    elif not is_last and hasattr(module, "no_sync"):
        with module.no_sync():
            yield
    else:
        yield


def finish_grad_sync(modules: list[nn.Module]) -> None:
    """Complete the data-parallel gradient average after the last backward of a step."""
    for module in modules:
        if hasattr(module, "finish_gradient_synchronization"):
            module.finish_gradient_synchronization()


@contextlib.contextmanager
def no_grad_sync(modules: list[nn.Module]) -> Iterator[None]:
    """Hold back DDP's per-gradient reductions (used around a whole pipeline schedule)."""
    with contextlib.ExitStack() as stack:
        for module in modules:
            if hasattr(module, "no_sync") and not isinstance(module, FSDPModule):
                stack.enter_context(module.no_sync())
        yield


# ---- optimiser ----------------------------------------------------------------------------------
def build_optimizer(model_parts: list[nn.Module], layout: Layout, run_cfg: RunConfig,
                    dp_group: dist.ProcessGroup | None) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter of this rank's parts; ZeRO-1 shards its state over
    `dp_group`, which must hold ranks with identical parameters: ParallelDims.replica_group()
    (dp x cp, or the expert-data-parallel group with expert parallel)."""
    seen: set[int] = set()
    params = []
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    o = run_cfg.optim
    kwargs = dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if layout.zero_stage == 1 and dp_group is not None and dist.get_world_size(dp_group) > 1:
        from training.parallel.zero import ShardedOptimizer

        return ShardedOptimizer(params, torch.optim.AdamW, process_group=dp_group, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


@torch.no_grad()
def clip_grad_norm(model_parts: list[nn.Module], max_norm: float,
                   pp_group: dist.ProcessGroup | None) -> float:
    """Clip by the global L2 norm over all stages (DTensor grads reduce over their own meshes)."""
    grads = [p.grad for part in model_parts for p in part.parameters() if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for g in grads:
        n = torch.linalg.vector_norm(g.float())
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = sq + n.to(sq.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device) if not isinstance(g, DTensor) else coef.item())
    return float(total)
