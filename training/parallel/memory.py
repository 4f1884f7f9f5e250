"""What one rank really allocates, in the terms of the plan's `memory_per_gpu_bytes` (parameters,
gradients, optimizer state, activations at the peak), measured on the job's first step.

On any device, from the tensors themselves: the bytes of the distinct storages (de-duplicated by
data pointer; a DTensor's local shard) of the parameters, of their gradients after the data-parallel
reduction, and of the optimizer's state plus mixed precision's fp32 masters
(training.parallel.precision). Activations are the peak, over the step's forward and backward, of
the bytes autograd holds for backward (saved-tensor hooks, torch.autograd.graph.saved_tensors_hooks),
parameters excluded: with micro-batches that is one micro-batch's, with a pipeline schedule the
micro-batches in flight. On CUDA the allocator's peak of the step (torch.cuda.max_memory_allocated)
is reported as well, as `peak_allocated` (everything: workspace, buckets, temporaries).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from training.parallel.precision import master_weights_of
from training.parallel.wrapping import local_tensor


@dataclass(frozen=True)
class MemoryAccount:
    """One rank's bytes per term (the plan's memory_per_gpu_bytes keys)."""

    params: int
    grads: int
    optimizer: int
    activations: int | None  # None when not measured (a torch.compile'd model)
    peak_allocated: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the step

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage holding `t` (a DTensor's local shard), None if none."""
    t = local_tensor(t)
    if t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
        key = st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (DTensor-like) without a storage
        key = id(t), t.numel() * t.element_size()
    return key if key[1] else None


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a storage shared by views counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        key = _storage_key(t)
        if key is not None:
            seen[key[0]] = key[1]
    return sum(seen.values())


def _params(parts: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for part in parts for p in part.parameters()]


def grad_bytes(parts: Sequence[nn.Module]) -> int:
    return storage_bytes(p.grad for p in _params(parts))


def optimizer_bytes(optimizers: Sequence[Any]) -> int:
    """The optimizer state (AdamW's moments, ZeRO-1: this rank's shard and its shadow of the next
    rank's, if kept) and fp32 masters."""
    tensors: list[torch.Tensor] = []
    for opt in optimizers:
        inner, held = opt, []
        while getattr(inner, "inner", None) is not None:  # mixed precision -> ZeRO-1 -> AdamW
            if getattr(inner, "shadow", None) is not None:
                held.append(inner.shadow)
            inner = inner.inner
        for state in (s for o in (inner, *held) for s in o.state.values()):
            tensors.extend(v for v in state.values() if torch.is_tensor(v))
    for masters in master_weights_of(optimizers):
        tensors.extend(masters.masters)
    return storage_bytes(tensors)


class _Held:
    """A saved tensor and its share of the meter's live bytes, released when autograd drops it."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, ptr: int) -> None:
        self.meter, self.tensor, self.ptr = meter, tensor, ptr

    def __del__(self) -> None:
        self.meter.release(self.ptr)


class SavedTensorMeter:
    """Peak bytes of the storages autograd saves for backward, parameters excluded."""

    def __init__(self, parts: Sequence[nn.Module], saved_hooks: bool = True) -> None:
        # saved_hooks=False (a torch.compile'd model: hooks would break its graphs): state terms only.
        self.saved_hooks = saved_hooks
        self.live: dict[int, list[int]] = {}  # data pointer -> [references, bytes]
        self.current = 0
        self.peak = 0
        self.parts = list(parts)
        # Parameters gathered for compute (FSDP2's unsharded parameters), seen after each forward.
        self.persistent = {k[0] for p in _params(parts) if (k := _storage_key(p)) is not None}
        self.gathered_bytes = 0
        # Under pipeline parallelism, FSDP2's unsharded gradients just before the stage's one
        # reduce-scatter (pipelining's REDUCE_GRAD; see service.planner.formulas.model_state_bytes).
        self.unsharded_grad_bytes = 0

    def _after_forward(self, *_: Any) -> None:
        keys = {k for p in _params(self.parts) if (k := _storage_key(p)) is not None}
        gathered = sum(n for ptr, n in keys if ptr not in self.persistent)
        self.gathered_bytes = max(self.gathered_bytes, gathered)

    def pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t  # noqa: SLF001 - a view of a parameter
        if isinstance(base, nn.Parameter):
            return t
        key = _storage_key(t)
        if key is None:
            return t
        ptr, nbytes = key
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(self, t, ptr)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    def before_reduce_grad(self) -> None:
        """FSDP2 under a pipeline schedule: every backward ran without resharding or gradient sync,
        so the gathered parameters and the unsharded fp32 gradients are all held here."""
        held = [fp for part in self.parts for fp in _fsdp_params(part) if hasattr(fp, "_unsharded_param")]
        params = [fp._unsharded_param for fp in held]  # noqa: SLF001 - FSDP2 has no public view
        self.gathered_bytes = max(self.gathered_bytes, storage_bytes(params))
        grads = [fp.unsharded_accumulated_grad if fp.unsharded_accumulated_grad is not None else p.grad
                 for fp, p in zip(held, params, strict=True)]
        self.unsharded_grad_bytes = max(self.unsharded_grad_bytes, storage_bytes(grads))

    @contextlib.contextmanager
    def track(self, device: torch.device, stages: Sequence[Any] = ()) -> Iterator[SavedTensorMeter]:
        """Meter the step run inside; `stages`: the pipeline's stages (PipelineStage), whose
        gradient reduction is sampled first."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        handles = [part.register_forward_hook(self._after_forward) for part in self.parts]
        for stage in stages:
            stage.perform_reduce_grad = functools.partial(_sampled, self, stage.perform_reduce_grad)
        try:
            with (torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack) if self.saved_hooks
                  else contextlib.nullcontext()):
                yield self
        finally:
            for handle in handles:
                handle.remove()
            for stage in stages:
                del stage.perform_reduce_grad  # the class's method again


def _sampled(meter: SavedTensorMeter, reduce_grad: Any, *args: Any, **kwargs: Any) -> Any:
    meter.before_reduce_grad()
    return reduce_grad(*args, **kwargs)


def _fsdp_params(module: nn.Module) -> list[Any]:
    """FSDP2's per-parameter state (FSDPParam) of every fully_shard'ed module in `module`."""
    out: list[Any] = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = fully_shard.state(m)._fsdp_param_group  # noqa: SLF001 - FSDP2 has no public view
            out.extend(group.fsdp_params if group is not None else ())
    return out


def account(parts: Sequence[nn.Module], optimizers: Sequence[Any], grads: int, meter: SavedTensorMeter,
            device: torch.device, zero_stage: int) -> MemoryAccount:
    """The account after the first optimizer step (AdamW allocates its state lazily in it); `grads`
    was measured before the step (zero_grad frees them). ZeRO-2 (FSDP2 without resharding after
    forward) holds every gathered parameter from forward to backward: they count as parameters;
    ZeRO-3 gathers one block at a time (the plan's `buffers`), except under a pipeline, where the
    stage's parameters stay gathered and its gradients unsharded until the reduction."""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    pipelined = meter.unsharded_grad_bytes > 0
    gathered = meter.gathered_bytes if zero_stage == 2 or pipelined else 0
    grads = max(grads, meter.unsharded_grad_bytes)
    return MemoryAccount(params=storage_bytes(_params(parts)) + gathered, grads=grads,
                         optimizer=optimizer_bytes(optimizers),
                         activations=meter.peak if meter.saved_hooks else None,
                         peak_allocated=peak)


def compare(measured: dict[str, Any], planned: dict[str, Any]) -> dict[str, float | None]:
    """measured / planned for each term both have (None where the plan says 0)."""
    out: dict[str, float | None] = {}
    for key in ("params", "grads", "optimizer", "activations"):
        m, p = measured.get(key), planned.get(key)
        if isinstance(m, int | float) and isinstance(p, int | float):
            out[key] = m / p if p else None
    return out
