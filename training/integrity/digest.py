"""The model digest: sha256 of the full, unsharded float32 parameters in canonical name order.

Identical for any layout that computed the same weights: DTensor shards (TP, FSDP) are gathered
with `full_tensor()`, pipeline stages are gathered from every pipeline rank, and names are the
canonical ones of `training.model.transformer` (wrapper prefixes removed). Canonical order is the natural
sort of the names (layer numbers compared as integers).
"""

from __future__ import annotations

import ctypes
import hashlib
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from training.config.layout import Layout
from training.model.transformer import canonical_name
from training.parallel.wrapping import unwrap


def _natural_key(name: str) -> list[tuple[int, int | str]]:
    return [(0, int(tok)) if tok.isdigit() else (1, tok) for tok in re.split(r"(\d+)", name) if tok]


@torch.no_grad()
def full_state(model_parts: list[nn.Module], layout: Layout,
               mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model as a float32 CPU tensor, on every rank (collective)."""
    local: dict[str, torch.Tensor] = {}
    for part in model_parts:
        for name, p in unwrap(part).named_parameters():
            t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            local[canonical_name(name)] = t.float().cpu().clone()
    if mesh is not None and layout.pp > 1:
        gathered: list[dict[str, torch.Tensor] | None] = [None] * layout.pp
        dist.all_gather_object(gathered, local, group=mesh["pp"].get_group())
        for part_state in gathered:
            assert part_state is not None
            local.update(part_state)
    return {name: local[name] for name in sorted(local, key=_natural_key)}


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        data = t.detach().float().cpu().contiguous()
        # Raw float32 bytes without numpy (not a dependency): read the tensor's memory directly.
        h.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))
    return h.hexdigest()


def model_digest(model_parts: list[nn.Module], layout: Layout, mesh: DeviceMesh | None) -> str:
    """sha256 hex digest of the full float32 parameters; the same on every rank (collective)."""
    return state_digest(full_state(model_parts, layout, mesh))
