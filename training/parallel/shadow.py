"""The shadow shard's one exchange (training.parallel.zero.ShardedOptimizer, `shadow=True`).

Rank r shadows the shard of r + 1 (mod N). A shadow is kept equal to its owner by stepping the same
arithmetic on the same inputs, so it only needs the owner's state once per optimizer instance:
before its first step, when the owner's state may have come from a checkpoint or a peer recovery.
Each rank then sends its owned state to the rank that shadows it (r - 1) and receives its buddy's
(r + 1): a description of the slots (shapes, dtypes, plain values), then the tensors, point to
point. Rank 0 receives before it sends and every other rank sends first, so the ring cannot
deadlock on a backend whose send waits for the matching receive.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from training.parallel.zero import ShardedOptimizer

log = logging.getLogger(__name__)

Meta = list[dict[str, tuple[Any, ...]]]


def _describe(state: dict[torch.Tensor, dict[str, Any]], params: list[torch.Tensor]) -> Meta:
    def one(v: Any) -> tuple[Any, ...]:
        if isinstance(v, torch.Tensor):
            v = _local(v)
            return ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."), v.device.type)
        return ("value", v)
    return [{k: one(v) for k, v in state.get(p, {}).items()} for p in params]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A received slot laid out like `param` (a DTensor slot of a TP-sharded parameter)."""
    if isinstance(param, DTensor) and local.shape == param.to_local().shape:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


def _comm_device(zopt: ShardedOptimizer) -> torch.device:
    """Where tensors travel: the parameters' device on NCCL, the CPU on gloo."""
    if dist.get_backend(zopt.process_group) == "nccl":
        return next(iter(zopt.all_params())).device
    return torch.device("cpu")


def _send(zopt: ShardedOptimizer, dst: int, device: torch.device) -> None:
    assert zopt.inner is not None
    owned = zopt.owned_params()
    state = zopt.inner.state
    dist.send_object_list([_describe(state, owned)], group=zopt.process_group, group_dst=dst,
                          device=device)
    for p in owned:
        for _, v in sorted(state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                dist.send(_local(v.detach()).to(device).contiguous(), group=zopt.process_group, group_dst=dst)


def _recv(zopt: ShardedOptimizer, src: int, device: torch.device) -> None:
    assert zopt.shadow is not None
    box: list[Any] = [None]
    dist.recv_object_list(box, group=zopt.process_group, group_src=src, device=device)
    meta: Meta = box[0]
    params = zopt.shadow_params()
    if len(meta) != len(params):
        raise RuntimeError(f"rank {src} owns {len(meta)} parameters, rank {zopt.rank} shadows {len(params)}")
    held = dict(zopt.shadow.state)  # a survivor's own shadow, kept across the failure
    zopt.shadow.state.clear()
    for p, slots in zip(params, meta, strict=True):
        if not slots:
            continue
        values: dict[str, Any] = {k: d[1] for k, d in slots.items() if d[0] == "value"}
        for k, d in sorted(slots.items()):
            if d[0] != "tensor":
                continue
            _, shape, dtype, kind = d
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(buf, group=zopt.process_group, group_src=src)
            values[k] = _like(p, buf.to("cpu" if kind == "cpu" else _local(p).device))
        zopt.shadow.state[p] = values
        if p in held and not _equal(held[p], values):  # the lockstep broke: optimizer state corrupted
            log.warning("rank %d: its shadow of rank %d's shard (param %d) differed from the owner's; "
                        "the owner's is kept", zopt.rank, src, zopt.param_index(p))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def same(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return torch.equal(_local(x).cpu(), _local(y).cpu())
        return not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) and bool(x == y)
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


@torch.no_grad()
def exchange_shadow_state(zopt: ShardedOptimizer) -> None:
    """Every rank's owned optimizer state into the shadow of the rank before it (collective)."""
    n, rank = zopt.world_size, zopt.rank
    device = _comm_device(zopt)
    before, after = (rank - 1) % n, (rank + 1) % n
    if rank == 0:
        _recv(zopt, after, device)
        _send(zopt, before, device)
    else:
        _send(zopt, before, device)
        _recv(zopt, after, device)
