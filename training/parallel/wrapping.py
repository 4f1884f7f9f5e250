"""Seeing through the parallel wrapping: the module inside a data-parallel wrapper, and the local
storage of a (possibly DTensor) tensor."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a data-parallel wrapper (training.parallel.ddp.DDP, ExpertDataParallel, torch
    DDP: each keeps it as `.module`); anything else (a model, an FSDP2 module) is returned as is."""
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) else module


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage this rank owns: the local shard of a DTensor (tensor / expert parallel), else `t`.

    In-place reductions and bit-level reads need the storage itself; `DTensor.to_local()` goes
    through autograd and may return a view or an async collective tensor.
    """
    return t._local_tensor if isinstance(t, DTensor) else t  # noqa: SLF001 - the storage, see above


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of the full tensor that `param` holds (all of it, or its DTensor shard)."""
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank already has the full value, so it just keeps its slice.
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(dtype=param.dtype, device=param.device))
