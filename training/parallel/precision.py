"""Mixed precision (RunConfig.precision, the job spec's `train.precision`).

  fp32            every tensor in float32 (the embedded CPU cluster's default; bit-identical to the
                  engine before mixed precision existed).
  bf16_fp32_adam  bf16 parameters, activations, gradients and gradient communication; float32 master
                  weights and float32 AdamW moments (Micikevicius et al. 2018, Mixed Precision
                  Training, Sec. 3.1; Rajbhandari et al. 2020, ZeRO, Sec. 3.1: 2 + 2 + 12 bytes per
                  parameter, service.planner.specs.PRECISIONS). The CUDA default.

How each parallel form gets there:
  - own DDP / ZeRO-1, TP/SP, PP, CP, EP: the model's parameters are cast to bf16 after they are
    materialised (`MasterWeights`), so every matmul, activation, gradient and DDP bucket is bf16
    (DDP all-reduces in the parameters' dtype). `MasterWeights` keeps one float32 master per
    parameter; around the optimizer step, checkpoints, digests and fingerprints
    (`MasterWeights.master_mode`) each parameter *object* temporarily holds its master (and a
    float32 copy of its gradient), so the optimizer's state, the checkpoint format and the
    integrity fingerprint are all those of the float32 masters. Under ZeRO-1 a rank keeps masters
    only for the parameters it owns, steps them, and the owners broadcast the new bf16 values.
  - FSDP2 (ZeRO-2/3): torch's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded
    float32 parameters are the masters, gathered parameters and gradients are bf16, the
    reduce-scatter runs in float32 (`fsdp_policy`).
Loss (log-softmax / cross-entropy), RMSNorm's statistics and RoPE stay float32 in the model itself
(training.model.transformer upcasts there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from training.config.run import ENGINE_PRECISIONS as PRECISIONS
from training.parallel.wrapping import local_tensor

if TYPE_CHECKING:
    from training.parallel.zero import ShardedOptimizer


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def is_mixed(precision: str) -> bool:
    return check_precision(precision) != "fp32"


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy: bf16 gathered params and gradients, fp32 reduce-scatter (torchtitan's default)."""
    if not is_mixed(precision):
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def set_data(p: torch.Tensor, data: torch.Tensor) -> None:
    """`p.data = data`, also for a DTensor parameter, whose local shard and spec live in Python
    attributes that `.data` assignment does not touch."""
    p.data = data
    if isinstance(p, DTensor):
        p._local_tensor = data._local_tensor  # type: ignore[attr-defined]  # noqa: SLF001
        p._spec = data._spec  # type: ignore[attr-defined]  # noqa: SLF001


def _unique(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class MasterWeights:
    """float32 masters of bf16 parameters, swapped into the parameter objects on demand.

    `owned`: the parameters this rank steps (ZeRO-1: its shard; otherwise all of them). Only those
    get a master; the others stay bf16 and are overwritten by their owner's broadcast.
    """

    def __init__(self, params: Sequence[nn.Parameter], owned: Sequence[nn.Parameter] | None = None) -> None:
        self.params = _unique(params)
        owned_ids = {id(p) for p in (owned if owned is not None else self.params)}
        self.owned = [p for p in self.params if id(p) in owned_ids]
        # The parameters still hold their fp32 initial values: those become the masters.
        self.masters = [p.data.detach().clone().float() for p in self.owned]
        self._compute = [p.data.to(torch.bfloat16) for p in self.owned]
        for p, c in zip(self.owned, self._compute, strict=True):
            set_data(p, c)
        for p in self.params:
            if p.dtype != torch.bfloat16:
                set_data(p, p.data.to(torch.bfloat16))
        self.active = False
        self.sharded: ShardedOptimizer | None = None

    def restrict(self, sharded: ShardedOptimizer) -> None:
        """Keep masters only for the parameters this rank steps under ZeRO-1; free the others."""
        self.sharded = sharded
        ids = {id(p) for p in sharded.owned_params()}
        keep = [i for i, p in enumerate(self.owned) if id(p) in ids]
        self.owned = [self.owned[i] for i in keep]
        self.masters = [self.masters[i] for i in keep]
        self._compute = [self._compute[i] for i in keep]

    @contextlib.contextmanager
    def master_mode(self, with_grads: bool = False) -> Iterator[None]:
        """Owned parameters hold their fp32 masters (and, `with_grads`, an fp32 copy of their
        gradient); on exit the bf16 compute copies are refreshed from the masters."""
        if self.active:  # re-entrant (a checkpoint inside a step)
            yield
            return
        self.active = True
        grads: list[torch.Tensor | None] = []
        try:
            with torch.no_grad():
                for p, m in zip(self.owned, self.masters, strict=True):
                    g = p.grad
                    grads.append(g)
                    set_data(p, m)
                    p.grad = g.float() if (with_grads and g is not None) else None
            others = self._gather_others() if (self.sharded is not None and not with_grads) else []
            yield
        finally:
            with torch.no_grad():
                for p, bf16 in others:  # a checkpoint load may have changed them
                    bf16.copy_(p.data)
                    set_data(p, bf16)
                for p, m, c, g in zip(self.owned, self.masters, self._compute, grads, strict=True):
                    c.copy_(m)
                    set_data(p, c)
                    p.grad = None if with_grads else g
            self.active = False

    def _gather_others(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """ZeRO-1: every rank takes the other owners' fp32 masters (one broadcast per parameter; for
        checkpoints and digests only, never in a step)."""
        sharded = self.sharded
        assert sharded is not None
        owned = {id(p) for p in self.owned}
        others = [(p, p.data) for p in sharded.all_params() if id(p) not in owned]
        for p, bf16 in others:
            set_data(p, bf16.float())
        for p in sharded.all_params():
            dist.broadcast(local_tensor(p.data), group=sharded.process_group, group_src=sharded.owner_of(p))
        return others


class MixedPrecisionOptimizer:
    """An optimizer over MasterWeights: steps the fp32 masters, leaves bf16 parameters behind.

    Under ZeRO-1 (`inner` a ShardedOptimizer) the owners broadcast the updated bf16 values after
    the masters have been copied back, so the broadcast moves 2 bytes per parameter.
    """

    def __init__(self, inner: torch.optim.Optimizer, masters: MasterWeights) -> None:
        self.inner = inner
        self.masters = masters

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> object:
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        from training.parallel.zero import ShardedOptimizer

        with self.masters.master_mode(with_grads=True):
            if isinstance(self.inner, ShardedOptimizer):
                self.inner.step_owned()
            else:
                self.inner.step()
        if isinstance(self.inner, ShardedOptimizer):
            self.inner.broadcast_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.masters.params:
            p.grad = None

    def state_dict(self) -> dict:
        with self.masters.master_mode():
            return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        with self.masters.master_mode():
            self.inner.load_state_dict(state_dict)


def with_masters(optimizer: torch.optim.Optimizer, part: nn.Module) -> torch.optim.Optimizer:
    """`optimizer` stepping the fp32 masters of `part` (set by training.parallel.parallelize for a
    bf16 run); the optimizer itself for fp32 runs and FSDP2 (whose sharded parameters are fp32)."""
    from training.parallel.zero import ShardedOptimizer

    masters = getattr(part, "master_weights", None)
    if not isinstance(masters, MasterWeights):
        return optimizer
    if isinstance(optimizer, ShardedOptimizer):
        masters.restrict(optimizer)
    return MixedPrecisionOptimizer(optimizer, masters)  # type: ignore[return-value]


def plain_optimizer(optimizer: Any) -> Any:
    """The optimizer behind a MixedPrecisionOptimizer (itself otherwise)."""
    return optimizer.inner if isinstance(optimizer, MixedPrecisionOptimizer) else optimizer


def master_weights_of(optimizers: Sequence[object], replicated_only: bool = False) -> list[MasterWeights]:
    """The MasterWeights behind `optimizers`; `replicated_only`: those holding a master for every
    parameter (not ZeRO-1 shards, whose replicas compare their identical bf16 parameters)."""
    from training.parallel.zero import ShardedOptimizer

    return [o.masters for o in optimizers if isinstance(o, MixedPrecisionOptimizer)
            and not (replicated_only and isinstance(o.inner, ShardedOptimizer))]


@contextlib.contextmanager
def masters_in_place(optimizers: Sequence[object], replicated_only: bool = False) -> Iterator[None]:
    """Every mixed-precision part's parameters hold their fp32 masters (checkpoint, digest,
    fingerprint); a no-op for fp32 runs."""
    with contextlib.ExitStack() as stack:
        for m in master_weights_of(optimizers, replicated_only):
            stack.enter_context(m.master_mode())
        yield
