"""Data parallel written by hand: the lecture's exercise 3 (naive -> flat -> overlapped -> bucketed).

Every rank holds the whole model and computes gradients on its own slice of the global batch;
the gradients are then averaged over the data-parallel group so that all replicas take the same
step. Three variants share one interface (`forward`, `no_sync()`, `finish_gradient_synchronization()`,
`.module`):

- `NaiveDDP`: after backward, one blocking all-reduce per parameter.
- `FlatDDP`: after backward, every gradient copied into one flat buffer, one all-reduce.
- `DDP`: all-reduces launched asynchronously from `register_post_accumulate_grad_hook` while the
  backward pass is still running, grouped into buckets of `bucket_size_mb` (None = one all-reduce
  per parameter), so communication overlaps the rest of backward.

Usage (one optimizer step, with gradient accumulation over micro-batches):

    model = DDP(net, bucket_size_mb=25.0, process_group=dp_group)
    for mb in micro_batches[:-1]:
        with model.no_sync():           # hooks do not communicate: gradients only accumulate
            model(mb).backward()
    model(micro_batches[-1]).backward() # hooks reduce the accumulated gradients as they become ready
    model.finish_gradient_synchronization()
    optimizer.step()

Assumption shared with torch DDP: all ranks of the group run the same graph, so every rank
launches the same collectives in the same order (buckets are launched strictly in bucket order to
keep that true even when gradients become ready in a different order on different ranks).
Nothing here assumes a device: gloo tensors on CPU, NCCL tensors on GPU.

`apply_data_parallel` picks the wrapper a layout runs with (ZeRO-0/1): `DDP`, or torch DDP.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from training.config.layout import Layout, LayoutError
from training.parallel.wrapping import local_tensor

log = logging.getLogger(__name__)

_MB = 1024 * 1024


def unique_params(module: nn.Module, requires_grad: bool | None = None) -> list[nn.Parameter]:
    """Parameters in registration order, each once even when tied (`parameters()` deduplicates)."""
    return [p for p in module.parameters() if requires_grad is None or p.requires_grad == requires_grad]


def broadcast_module_state(module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
    """Make every replica start from the group's rank 0: parameters (frozen ones too) and buffers.

    Tensors are flattened per (dtype, device) so the broadcast is a handful of calls, not one per tensor.
    """
    if dist.get_world_size(process_group) == 1:
        return
    tensors = [local_tensor(p.detach()) for p in module.parameters()]
    tensors += [local_tensor(b) for b in module.buffers()]
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in groups.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            dist.broadcast(flat, group=process_group, group_src=0)
            offset = 0
            for t in ts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class _DataParallel(nn.Module):
    """What the three variants share: the wrapped module, the group, the start-up broadcast, no_sync."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.require_gradient_sync = True
        broadcast_module_state(module, process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into `.grad`; the next synced backward reduces the sum.

        The flag is read while gradients are accumulated, so run `backward()` inside the context.
        """
        previous = self.require_gradient_sync
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def _grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, local_tensor(p.grad)) for p in unique_params(self.module, True) if p.grad is not None]


class NaiveDDP(_DataParallel):
    """One blocking all-reduce per parameter, after the whole backward pass (the baseline)."""

    def finish_gradient_synchronization(self) -> None:
        if self.world_size == 1:
            return
        for _, g in self._grads():
            dist.all_reduce(g, group=self.process_group)
            g.div_(self.world_size)


class FlatDDP(_DataParallel):
    """All gradients copied into one flat buffer per dtype, one all-reduce, copied back."""

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, process_group)
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # reused across steps

    def finish_gradient_synchronization(self) -> None:
        if self.world_size == 1:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for _, g in self._grads():
            groups.setdefault((g.dtype, g.device), []).append(g)
        with torch.no_grad():
            for key, grads in groups.items():
                numel = sum(g.numel() for g in grads)
                if key not in self._flat or self._flat[key].numel() != numel:
                    self._flat[key] = torch.empty(numel, dtype=key[0], device=key[1])
                flat = self._flat[key]
                torch.cat([g.reshape(-1) for g in grads], out=flat)
                dist.all_reduce(flat, group=self.process_group)
                flat.div_(self.world_size)
                offset = 0
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor  # flat, one dtype and device; params' gradients packed in order
    views: list[torch.Tensor] = field(default_factory=list)  # buffer slices, one per param, param-shaped
    ready: set[int] = field(default_factory=set)  # positions whose gradient has been accumulated
    launched: bool = False
    dirty: bool = False  # a gradient was accumulated again after the bucket's all-reduce left
    work: Any = None

    def reset(self) -> None:
        self.ready.clear()
        self.launched = False
        self.dirty = False
        self.work = None


class DDP(_DataParallel):
    """Overlapped, bucketed data parallel (the torch DDP design, written out).

    Buckets hold parameters in reverse registration order (roughly the order backward produces
    their gradients), cut at `bucket_size_mb` and at dtype/device changes; `None` gives one bucket
    per parameter. A bucket is all-reduced asynchronously as soon as every gradient in it has been
    accumulated and every earlier bucket has been launched.

    Tied (shared) parameters are registered once (`parameters()` deduplicates) and autograd runs a
    leaf's AccumulateGrad once per backward after summing every use, so the hook fires once, after
    the last use. Should a gradient be accumulated again after its bucket left (a re-entrant
    backward, e.g. reentrant activation checkpointing), the bucket is marked dirty and reduced again
    from the final gradients in `finish_gradient_synchronization`, so the result is always correct.
    Parameters with `requires_grad=False` get no hook and are never reduced. A parameter that got no
    gradient on this rank contributes zeros; it stays `None` only if no rank had a gradient for it.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_size_mb: float | None = 25.0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if bucket_size_mb is not None and not bucket_size_mb > 0:
            raise ValueError(
                f"bucket_size_mb must be > 0 or None (one bucket per parameter), got {bucket_size_mb}"
            )
        super().__init__(module, process_group)
        self.bucket_size_mb = bucket_size_mb
        self._buckets = self._build_buckets(unique_params(module, True), bucket_size_mb)
        self._next_to_launch = 0
        self._hook_handles: list[Any] = []
        self.late_rereductions = 0  # buckets reduced a second time because a gradient arrived after launch
        # Gradient SDC checks (training.integrity.gradient.GradientAudit), set by the train loop: they
        # read each bucket as packed and as reduced, and never write it.
        self.grad_audit: Any = None
        if self.world_size > 1:
            for bi, bucket in enumerate(self._buckets):
                for pos, p in enumerate(bucket.params):
                    hook = functools.partial(self._on_grad_accumulated, bi, pos)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        log.debug("DDP: %d buckets of %s MB, %d ranks", len(self._buckets), bucket_size_mb, self.world_size)

    @staticmethod
    def _build_buckets(params: list[nn.Parameter], bucket_size_mb: float | None) -> list[_Bucket]:
        cap = None if bucket_size_mb is None else bucket_size_mb * _MB
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            t = local_tensor(p)
            nbytes = t.numel() * t.element_size()
            prev = local_tensor(groups[-1][-1]) if groups else None
            if (
                prev is None
                or cap is None
                or size + nbytes > cap
                or prev.dtype != t.dtype
                or prev.device != t.device
            ):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buckets = []
        for ps in groups:
            first = local_tensor(ps[0])
            numel = sum(local_tensor(p).numel() for p in ps)
            bucket = _Bucket(params=ps, buffer=torch.zeros(numel, dtype=first.dtype, device=first.device))
            offset = 0
            for p in ps:
                t = local_tensor(p)
                bucket.views.append(bucket.buffer[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            buckets.append(bucket)
        return buckets

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def bucket_param_counts(self) -> list[int]:
        return [len(b.params) for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the wrapper is no longer used)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    def _on_grad_accumulated(self, bucket_index: int, position: int, param: torch.Tensor) -> None:
        if not self.require_gradient_sync:
            return
        bucket = self._buckets[bucket_index]
        if bucket.launched:
            bucket.dirty = True
            return
        bucket.ready.add(position)
        # Launch in bucket order only, so every rank issues the same collectives in the same order.
        while self._next_to_launch < len(self._buckets):
            nxt = self._buckets[self._next_to_launch]
            if len(nxt.ready) < len(nxt.params):
                break
            self._launch(nxt)
            self._next_to_launch += 1

    def _pack(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(local_tensor(p.grad))

    def _audit_record(self, bucket: _Bucket) -> None:
        if self.grad_audit is not None:
            self.grad_audit.record(next(i for i, b in enumerate(self._buckets) if b is bucket), bucket.buffer)

    def _launch(self, bucket: _Bucket) -> None:
        self._pack(bucket)
        self._audit_record(bucket)
        bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
        bucket.launched = True

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket (launching those whose gradients never all arrived), average, copy back."""
        if self.world_size == 1:
            return
        while self._next_to_launch < len(self._buckets):
            self._launch(self._buckets[self._next_to_launch])
            self._next_to_launch += 1
        for bucket in self._buckets:
            bucket.work.wait()
        for bucket in self._buckets:
            if bucket.dirty:
                log.debug("DDP: re-reducing a bucket whose gradient was accumulated after launch")
                self._pack(bucket)
                self._audit_record(bucket)
                dist.all_reduce(bucket.buffer, group=self.process_group)
                self.late_rereductions += 1
        if self.grad_audit is not None:  # every rank, every step: the audit's gather is a collective
            self.grad_audit.verify([(b.params, b.views, b.buffer) for b in self._buckets])
        with torch.no_grad():
            for bucket in self._buckets:
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is not None:  # average and copy back in one pass over the memory
                        torch.div(view, self.world_size, out=local_tensor(p.grad))
                    elif not isinstance(p, DTensor) and bool(view.any()):
                        p.grad = view / self.world_size
                bucket.reset()
        self._next_to_launch = 0


def apply_data_parallel(model: nn.Module, layout: Layout, dp_group: dist.ProcessGroup,
                        dp_impl: str) -> nn.Module:
    """The data-parallel wrapper for ZeRO-0/1: ours (`DDP`, dp_impl "lattice") or torch DDP."""
    if dp_impl == "torch":
        if layout.tp > 1 or layout.pp > 1 or layout.ep > 1:
            raise LayoutError(
                "train.dp_impl 'torch' (torch DDP) needs tp = 1, pp = 1 and ep = 1; "
                "use dp_impl 'lattice' or zero_stage 2/3"
            )
        return torch.nn.parallel.DistributedDataParallel(model, process_group=dp_group)
    return DDP(model, process_group=dp_group)
