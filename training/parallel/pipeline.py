"""Pipeline parallelism with torch.distributed.pipelining.

The model is split by layers into pp x virtual_stages stages. The first stage also holds the
token embedding, the last the final norm, the output head and the loss. When the layers do
not divide evenly, the extra layers go to the middle stages first (the ends already carry the
embedding and the head + loss), then to the first stage (an embedding lookup is cheap), and to
the last stage (head + loss, the heaviest end) only when every other stage has one.

Stages are placed on pipeline ranks by the schedule's style: "loop" (stage s on rank s mod pp)
for GPipe, 1F1B and the interleaved schedules; "V" (rank r holds stages r and 2pp-1-r) for
ZBVZeroBubble and DualPipeV. Each stage is a `Transformer` pruned to its layers, with canonical
parameter names, parallelised by `training.parallel.parallelize.parallelize` (TP, recompute, FSDP).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from training.config.layout import Layout, LayoutError
from training.config.run import RunConfig
from training.config.spec import ModelSpec
from training.model.transformer import Transformer, prune_to_stage, sharded_cross_entropy
from training.parallel.mesh import ParallelDims
from training.parallel.parallelize import parallelize

SCHEDULE_CLASSES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")


def split_layers(num_layers: int, num_stages: int) -> list[list[int]]:
    """Consecutive layer ids per stage, sizes differing by at most one, extras to the middle."""
    if num_layers < num_stages:
        raise LayoutError(f"model.layers ({num_layers}) must be >= the pipeline stages ({num_stages})")
    base, extra = divmod(num_layers, num_stages)
    centre = (num_stages - 1) / 2
    # Middle stages first (nearest the centre first), then the first stage, the last stage last.
    order = sorted(range(num_stages), key=lambda s: (s == num_stages - 1, s == 0, abs(s - centre), s))
    counts = [base] * num_stages
    for s in order[:extra]:
        counts[s] += 1
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def stage_ids(layout: Layout, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank `pp_rank` holds, in execution order."""
    pp, v = layout.pp, layout.virtual_stages
    if layout.schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


@dataclass
class Pipeline:
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    stages: list[PipelineStage]
    modules: list[nn.Module]  # what each stage runs (possibly FSDP-wrapped), this rank's stages in order
    has_first: bool
    has_last: bool

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward over the micro-batches; this rank's mean loss if it has the last stage."""
        losses: list[torch.Tensor] = []
        if self.has_first:
            self.schedule.step(inputs, target=targets, losses=losses)
        else:
            self.schedule.step(target=targets, losses=losses)
        if self.has_last:
            return torch.stack([loss.detach().float() for loss in losses]).mean()
        return None


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_pipeline(spec: ModelSpec, cfg: RunConfig, dims: ParallelDims, device: torch.device,
                   loss_fn: LossFn | None = None) -> Pipeline:
    """Build this rank's stages on meta, parallelise each, and the schedule that drives them.

    The default loss is the cross-entropy of this CP rank's tokens (the targets the schedule
    hands the last stage are full sequences; with CP they are sharded like the inputs).
    """
    if loss_fn is None:
        loss_fn = functools.partial(sharded_cross_entropy, cp_rank=dims.cp_rank, cp_size=dims.layout.cp)
    layout = dims.layout
    if layout.schedule not in SCHEDULE_CLASSES:
        raise LayoutError(f"layout.schedule must be one of {', '.join(SCHEDULE_CLASSES)} when pp > 1")
    if layout.schedule == "dualpipev" and layout.num_microbatches < layout.num_stages:
        raise LayoutError(
            f"layout.num_microbatches ({layout.num_microbatches}) must be >= pp x virtual_stages "
            f"({layout.num_stages}) for schedule 'dualpipev'"
        )
    n_stages = layout.num_stages
    splits = split_layers(spec.layers, n_stages)
    pp_group = dims.group("pp")
    stages, modules = [], []
    ids = stage_ids(layout, dims.pp_rank)
    for sid in ids:
        with torch.device("meta"):
            part = Transformer(spec)
        prune_to_stage(part, splits[sid], first=sid == 0, last=sid == n_stages - 1)
        module = parallelize(part, layout, dims, cfg, device=device)
        modules.append(module)
        stages.append(PipelineStage(module, sid, n_stages, device, group=pp_group))
    cls = SCHEDULE_CLASSES[layout.schedule]
    try:
        # scale_grads: the loss is a per-micro-batch mean, so gradients are divided by their number.
        first = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
        schedule = cls(first, n_microbatches=layout.num_microbatches, loss_fn=loss_fn, scale_grads=True)
    except ValueError as e:
        raise LayoutError(f"layout.schedule {layout.schedule!r} cannot run this layout: {e}") from e
    return Pipeline(schedule=schedule, stages=stages, modules=modules,
                    has_first=0 in ids, has_last=n_stages - 1 in ids)
