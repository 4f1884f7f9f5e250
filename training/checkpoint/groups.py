"""Process-group helpers for the checkpoint protocol, each degrading to one process when
torch.distributed is not up: ranks and sizes, barrier, broadcast and gather of Python objects, and
running one step on rank 0 so that every rank returns or raises together."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from training.checkpoint.manifest import CheckpointError


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank(pg: Any) -> int:
    return dist.get_rank(pg) if is_distributed() else 0


def group_size(pg: Any) -> int:
    return dist.get_world_size(pg) if is_distributed() else 1


def global_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def barrier(pg: Any) -> None:
    if is_distributed():
        dist.barrier(group=pg)


def broadcast_from_0(value: Any, pg: Any) -> Any:
    if not is_distributed() or group_size(pg) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=pg, group_src=0)
    return box[0]


def all_gather(value: Any, pg: Any) -> list[Any]:
    if not is_distributed() or group_size(pg) == 1:
        return [value]
    out: list[Any] = [None] * group_size(pg)
    dist.all_gather_object(out, value, group=pg)
    return out


def run_on_rank0(fn: Any, pg: Any, error: type[Exception] = CheckpointError) -> Any:
    """Run fn on rank 0 of the group; every rank returns its result or raises `error` together."""
    outcome: tuple[bool, Any] = (True, None)
    failure: Exception | None = None
    if group_rank(pg) == 0:
        try:
            outcome = (True, fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            failure = e
            outcome = (False, str(e) if isinstance(e, error) else f"{type(e).__name__}: {e}")
    ok, value = broadcast_from_0(outcome, pg)
    if not ok:
        raise error(value) from failure
    return value
