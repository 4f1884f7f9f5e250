"""FSDP2 (ZeRO-2 / ZeRO-3): shard every block and the root over the data-parallel mesh with prefetch,
and materialise a meta-built model's weights (after sharding, so no rank holds a full copy).

ZeRO-2 keeps parameters gathered from forward to backward (reshard_after_forward=False), ZeRO-3
reshards them after forward, except under the split-backward pipeline schedules.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from training.model.transformer import Transformer
from training.parallel.precision import fsdp_policy

# Pipeline schedules that split backward into an input pass and a later weight pass. With them,
# FSDP2's reshard_after_forward=True gives wrong weight gradients in torch 2.13 (the stage's
# weight pass runs after the next micro-batch's forward has resharded the parameters; measured:
# parameters off by ~1e-2 after two steps on gloo), so ZeRO-3 stages keep their parameters
# gathered from forward to the end of the step there (torchtitan never reshards after forward
# under PP either); they are still sharded between steps.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")


def reshard_after_forward(zero_stage: int, schedule: str) -> bool:
    """Whether blocks free their gathered parameters after forward: ZeRO-3, not under split backward."""
    return zero_stage == 3 and schedule not in SPLIT_BACKWARD_SCHEDULES


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, reshard_after_forward: bool,
               device_type: str, precision: str = "fp32") -> None:
    mp = fsdp_policy(precision)  # training.parallel.precision: bf16 compute, fp32 sharded masters
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


def materialize(model: Transformer, seed: int, device: torch.device) -> None:
    """Allocate a meta-built model on `device` and initialise it by name (no-op if not on meta)."""
    if not any(p.is_meta for p in model.parameters()) and not model.rope_cos.is_meta:
        return
    model.to_empty(device=device)
    model.init_weights(seed)
