"""ZeRO stage 1 by hand: shard the optimizer state over the data-parallel group (lecture exercise 4).

Every rank still holds all parameters and (after the DDP all-reduce) the full averaged gradient,
but each parameter is *owned* by one rank, which alone keeps its optimizer state (for AdamW: two
moments, 8 bytes per fp32 parameter) and updates it; the owner then broadcasts the new values.
Optimizer state per rank drops to ~1/N for the price of one broadcast of the parameters, the same
traffic as the all-gather half of an all-reduce (Rajbhandari et al. 2020, ZeRO, section 5.1).

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=dp_group, lr=3e-4)
    # (optional broadcast_bucket_mb=25.0: the most bytes flattened into one broadcast)
    ...; ddp.finish_gradient_synchronization(); opt.step(); opt.zero_grad()

Partition: parameters are assigned greedily, largest first, each to the currently least-loaded rank
(ties: lowest rank; equal sizes: registration order), so it is deterministic and every rank computes
the same assignment. The load carries over between `add_param_group` calls.

Sharded state dict (what `state_dict()` returns and `load_state_dict()` takes):

    {"state": {param_index: {...the inner optimizer's per-param state...}},   # owned params only
     "param_groups": [{hyper-parameters..., "params": [param_index, ...]}],   # every param, every group
     "owned": [param_index, ...], "world_size": N, "rank": r}

`param_index` is the parameter's position in registration order over all groups (the order of
`self.param_groups`), identical on every rank. `load_state_dict` takes the entries for the
parameters this rank owns and ignores the others, so it accepts this rank's own shard or a union of
all ranks' shards (which is how a checkpoint reloads onto another world size).

Shadow shard (`shadow=True`, the job spec's fault_tolerance.shadow_optimizer): rank r also steps
the shard of its buddy b = (r + 1) % N in `self.shadow`, a second inner optimizer built over the
buddy's parameters with the same groups, order and hyper-parameters as the buddy's own `inner`.
Every rank holds the same parameters and averaged gradients, so the shadow's state equals the
owner's bit for bit, without any communication per step (the buddy's parameters it updates in
place are overwritten by the owner's broadcast with the same values). A lost rank's shard thus
survives on its predecessor (training.checkpoint.peer). The price: 1/N more optimizer state and
optimizer step time per rank. The shadow is not part of `state_dict`; the first step of each
optimizer instance copies every owner's state into its shadow (`sync_shadow`, one point-to-point
exchange), so a shadow is right after a checkpoint restore or a peer recovery as well.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from training.parallel.wrapping import local_tensor

log = logging.getLogger(__name__)


def partition_by_size(sizes: Sequence[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank for each size: largest first onto the least-loaded rank (LPT greedy, deterministic).

    `loads` (one entry per rank) is updated in place, so successive calls keep the balance.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = loads if loads is not None else [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return owners


class ShardedOptimizer(Optimizer):
    """A `torch.optim.Optimizer` that keeps state for, and steps, only this rank's share of parameters."""

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_cls: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        broadcast_bucket_mb: float = 25.0,
        shadow: bool = False,
        **kwargs: Any,
    ) -> None:
        if not broadcast_bucket_mb > 0:
            raise ValueError(f"broadcast_bucket_mb must be > 0, got {broadcast_bucket_mb}")
        self.broadcast_bucket_mb = broadcast_bucket_mb
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.optimizer_cls = optimizer_cls
        self.inner: Optimizer | None = None
        self.shadow_enabled = shadow and self.world_size > 1
        self.shadow: Optimizer | None = None  # steps the buddy's shard (shadow=True)
        self._shadow_synced = False
        self._owner: dict[torch.Tensor, int] = {}
        self._index: dict[torch.Tensor, int] = {}
        self._loads = [0] * self.world_size
        self._broadcast_plan: list[tuple[int, list[list[torch.Tensor]]]] | None = None
        self._inner_kwargs = kwargs
        # The outer groups carry every hyper-parameter (LR schedulers read and write them there);
        # a probe instance gives the class's defaults for those the caller did not pass (a CPU probe,
        # without `fused`, which no default depends on; the groups still carry the caller's value).
        probe = optimizer_cls([torch.zeros(1, requires_grad=True)],
                              **{k: v for k, v in kwargs.items() if k != "fused"})
        super().__init__(params, {**probe.defaults, **kwargs})

    # -- partition ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validates, fills defaults, appends to param_groups
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p not in self._index]
        for p in new:
            self._index[p] = len(self._index)
        owners = partition_by_size([local_tensor(p).numel() for p in new], self.world_size, self._loads)
        for p, owner in zip(new, owners, strict=True):
            self._owner[p] = owner
        self.inner = self._add_inner_group(self.inner, group, self.rank)
        if self.shadow_enabled:
            self.shadow = self._add_inner_group(self.shadow, group, self.buddy)
        self._broadcast_plan = None

    def _add_inner_group(self, inner: Optimizer | None, group: dict[str, Any], owner: int) -> Optimizer:
        """`group` restricted to `owner`'s parameters, appended to `inner` (built on the first call):
        the same construction for this rank's shard and for the shadow of the buddy's."""
        owned_group = {k: v for k, v in group.items() if k != "params"}
        owned_group["params"] = [p for p in group["params"] if self._owner[p] == owner]
        if inner is None:
            return self.optimizer_cls([owned_group], **self._inner_kwargs)
        inner.add_param_group(owned_group)
        return inner

    @property
    def buddy(self) -> int:
        """The rank whose shard this rank shadows, (rank + 1) mod N (rank - 1 mod N shadows this one)."""
        return (self.rank + 1) % self.world_size

    def shadow_params(self) -> list[nn.Parameter]:
        """The buddy's parameters, in param_index order (empty without a shadow)."""
        if not self.shadow_enabled:
            return []
        return [p for p in self._index if self._owner[p] == self.buddy]

    def owner_of(self, param: torch.Tensor) -> int:
        """Rank (within the process group) that owns `param`'s optimizer state."""
        try:
            return self._owner[param]
        except KeyError as e:
            raise KeyError("parameter is not managed by this ShardedOptimizer") from e

    def owned_params(self) -> list[nn.Parameter]:
        """This rank's parameters, in param_index order."""
        return [p for p in self._index if self._owner[p] == self.rank]

    def param_index(self, param: torch.Tensor) -> int:
        return self._index[param]

    def all_params(self) -> list[nn.Parameter]:
        """Every managed parameter in param_index order."""
        return list(self._index)

    def param_counts_per_rank(self) -> list[int]:
        """Elements owned by each rank (the balance the partition achieved)."""
        return list(self._loads)

    # -- step --------------------------------------------------------------------------------

    def _sync_hyperparameters(self) -> None:
        assert self.inner is not None
        for opt in (self.inner, self.shadow):
            if opt is None:
                continue
            for outer, inner in zip(self.param_groups, opt.param_groups, strict=True):
                for k, v in outer.items():
                    if k != "params":
                        inner[k] = v

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_owned()
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def step_owned(self) -> None:
        """Step this rank's shard only, without the broadcast (training.parallel.precision steps the
        fp32 masters this way, then broadcasts the bf16 parameters)."""
        assert self.inner is not None
        self._sync_hyperparameters()
        if self.shadow is not None:
            if not self._shadow_synced:
                self.sync_shadow()
            self.shadow.step()  # the buddy's parameters: overwritten by its broadcast, same values
        self.inner.step()

    def sync_shadow(self) -> None:
        """Copy every owner's optimizer state into its shadow (collective over the group: every
        rank calls it; training.parallel.shadow)."""
        from training.parallel.shadow import exchange_shadow_state

        assert self.inner is not None and self.shadow is not None
        exchange_shadow_state(self)
        self._shadow_synced = True

    def broadcast_plan(self) -> list[tuple[int, list[list[torch.Tensor]]]]:
        """For each owner rank, its parameters' local tensors in chunks of one (dtype, device) and at
        most `broadcast_bucket_mb` (a lone larger tensor is its own chunk)."""
        if self._broadcast_plan is None:
            cap = self.broadcast_bucket_mb * 1024 * 1024
            plan: list[tuple[int, list[list[torch.Tensor]]]] = []
            for owner in range(self.world_size):
                groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
                for p, o in self._owner.items():
                    if o == owner:
                        t = local_tensor(p.detach())
                        groups.setdefault((t.dtype, t.device), []).append(t)
                chunks: list[list[torch.Tensor]] = []
                for tensors in groups.values():
                    first, size = len(chunks), 0
                    for t in tensors:
                        nbytes = t.numel() * t.element_size()
                        if len(chunks) == first or size + nbytes > cap:
                            chunks.append([])
                            size = 0
                        chunks[-1].append(t)
                        size += nbytes
                plan.append((owner, chunks))
            self._broadcast_plan = plan
        return self._broadcast_plan

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every owner sends its updated parameters, flattened into a few chunks (a transient buffer of
        at most `broadcast_bucket_mb`, or one tensor if larger, instead of one call per parameter)."""
        if self.world_size == 1:
            return
        for owner, groups in self.broadcast_plan():
            for tensors in groups:
                if owner == self.rank:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    n = sum(t.numel() for t in tensors)
                    flat = torch.empty(n, dtype=tensors[0].dtype, device=tensors[0].device)
                dist.broadcast(flat, group=self.process_group, group_src=owner)
                if owner != self.rank:
                    offset = 0
                    for t in tensors:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every rank computes full gradients under ZeRO-1, so clear them all, not just the shard."""
        super().zero_grad(set_to_none=set_to_none)

    # -- state -------------------------------------------------------------------------------

    def _inner_order(self) -> list[torch.Tensor]:
        assert self.inner is not None
        return [p for g in self.inner.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        assert self.inner is not None
        inner_sd = self.inner.state_dict()
        order = self._inner_order()
        state = {self._index[order[i]]: s for i, s in inner_sd["state"].items()}
        groups = []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [self._index[p] for p in g["params"]]
            groups.append(entry)
        owned = [self._index[p] for p in self.owned_params()]
        return {"state": state, "param_groups": groups, "owned": owned,
                "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        assert self.inner is not None
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state_dict has {len(groups)} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        for saved, g in zip(groups, self.param_groups, strict=True):
            if len(saved["params"]) != len(g["params"]):
                raise ValueError(
                    f"optimizer state_dict param group has {len(saved['params'])} params, "
                    f"expected {len(g['params'])}"
                )
        state = {int(k): v for k, v in state_dict["state"].items()}
        order = self._inner_order()
        inner_state = {i: state[self._index[p]] for i, p in enumerate(order) if self._index[p] in state}
        inner_groups = []
        i = 0
        for saved, outer, inner in zip(groups, self.param_groups, self.inner.param_groups, strict=True):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            outer.update(hyper)
            inner_groups.append({**hyper, "params": list(range(i, i + len(inner["params"])))})
            i += len(inner["params"])
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        missing = [self._index[p] for p in order if self._index[p] not in state]
        if missing and state:
            log.debug("ShardedOptimizer rank %d: no saved state for owned params %s", self.rank, missing)
