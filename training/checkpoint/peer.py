"""Peer recovery: a lost rank's state comes from a healthy DP peer's memory, not from a checkpoint.

After TorchFT's live recovery. When a rank dies, its peers' training loops fail out of the
collective they were in; each keeps its state in memory (`capture`, no collective: the process
group is already broken) if it stopped between optimizer updates. The next attempt rebuilds every
rank's `Trainer` on a fresh process group; then

- a survivor loads its own kept state (`load_kept`),
- each source survivor sends its state to the replacement(s) it serves (`send_state`, point to
  point over the collective backend: gloo on CPU, NCCL on GPU), and the replacement receives it
  into its freshly built model and optimizer (`recv_state`),
- every rank checks its DP replica group agrees bit for bit (`verify`: the exact parameter
  fingerprint of training.integrity.fingerprint); a disagreement fails the attempt and the
  controller falls back to the verified checkpoint.

This needs replicas that hold everything a rank holds: ZeRO-0 (DDP), no expert parallelism (a bf16
run's fp32 masters travel in place of its bf16 copies); workers.recovery_path decides when the peer
path applies.

ZeRO-1 with shadow shards (training.parallel.zero, `shadow=True`): rank r keeps its own optimizer
shard and a bit-identical shadow of its successor's, so a rank keeps both, and the source of a lost
rank L must be the rank that shadows it (L - 1 in the ZeRO group): it sends its parameters, its data
position and, as L's own shard, its shadow. L's shadow of L + 1's shard, like every other shadow, is
copied from its owner before the first step of the new attempt (`ShardedOptimizer.sync_shadow`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from training.integrity.fingerprint import find_divergent_replicas, param_fingerprint
from training.integrity.history import load_local_history, local_history
from training.parallel.precision import masters_in_place, plain_optimizer
from training.parallel.zero import ShardedOptimizer


class PeerRestoreError(RuntimeError):
    """The peer transfer could not give this rank its replicas' state; the attempt fails and the
    controller restores the verified checkpoint instead (not an SDC: nothing blames a node)."""


@dataclass
class KeptState:
    """One rank's state at the end of optimizer step `step`, held in memory across attempts."""

    step: int
    params: list[torch.Tensor]  # local shards (DTensor.to_local) in parameter order over the parts
    optim: list[dict[str, Any]]  # per parameter: optimizer slot -> local tensor or plain value
    data: dict[str, Any] = field(default_factory=dict)
    # ZeRO-1 with shadow shards: per parameter, the shadow's slots (those of the successor's shard)
    shadow: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, Any] = field(default_factory=dict)  # the integrity checks' histories

    @property
    def nbytes(self) -> int:
        tensors = [*self.params, *(v for slots in [*self.optim, *self.shadow] for v in slots.values()
                                   if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def for_successor(self) -> KeptState:
        """What a ZeRO-1 rank sends the replacement of the rank it shadows: its shadow is that
        rank's own shard (the replacement's shadow comes from its owner at the first step)."""
        return KeptState(self.step, self.params, self.shadow, self.data, checks=self.checks)


@dataclass(frozen=True)
class PeerPlan:
    """What one rank does in a peer recovery: `receive_from` (a replacement) or `send_to` (a source),
    or neither (a survivor that only reloads its own state). All resume after `step`."""

    step: int
    receive_from: int | None = None
    send_to: tuple[int, ...] = ()

    @classmethod
    def for_rank(cls, rank: int, step: int, sources: dict[int, int]) -> PeerPlan:
        """`sources`: replacement rank -> the survivor that sends it its state."""
        return cls(step, sources.get(rank), tuple(sorted(d for d, s in sources.items() if s == rank)))


def _params(trainer: Any) -> list[torch.nn.Parameter]:
    return [p for _, p in trainer.named_parameters()]


def _sharded(trainer: Any) -> list[ShardedOptimizer]:
    return [o for o in map(plain_optimizer, trainer.optimizers) if isinstance(o, ShardedOptimizer)]


def _holders(trainer: Any, shadow: bool = False) -> list[torch.optim.Optimizer]:
    """The optimizers whose `.state` holds the slots: a ZeRO-1 optimizer's inner one (or, `shadow`,
    its shadow), any other optimizer itself."""
    out = []
    for opt in map(plain_optimizer, trainer.optimizers):
        held = (opt.shadow if shadow else opt.inner) if isinstance(opt, ShardedOptimizer) else opt
        if held is not None and not (shadow and held is opt):
            out.append(held)
    return out


def _slots(trainer: Any, shadow: bool = False) -> dict[torch.nn.Parameter, dict[str, Any]]:
    """Each parameter's optimizer state (exp_avg, exp_avg_sq, step for AdamW); `shadow`: the
    ZeRO-1 shadow shard's."""
    out: dict[torch.nn.Parameter, dict[str, Any]] = {}
    for opt in _holders(trainer, shadow):
        out.update(opt.state)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def eligible(cfg: Any) -> bool:
    """Whether a DP peer holds all of a rank's state (RunConfig.peer_recovery_blocker)."""
    return cfg.peer_recovery_blocker() is None


@torch.no_grad()
def capture(trainer: Any) -> KeptState:
    """This rank's parameters, optimizer state and data position (local, no collective). No copy:
    the failed attempt's tensors are kept alive by reference (its modules, gradients and activations
    are freed with it), and the next attempt copies them into its own."""
    params = _params(trainer)

    def kept_slots(slots: dict[torch.nn.Parameter, dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: _local(v).detach() if isinstance(v, torch.Tensor) else v
                 for k, v in slots.get(p, {}).items()} for p in params]

    optim = kept_slots(_slots(trainer))
    shadowed = any(o.shadow is not None for o in _sharded(trainer))
    shadow = kept_slots(_slots(trainer, shadow=True)) if shadowed else []
    with masters_in_place(trainer.optimizers):  # a bf16 run keeps its fp32 masters, not the copies
        values = [_local(p).detach() for p in params]
    # The data position of the kept step: a rank failing inside the next step has read its batch.
    data = trainer.data.state_dict(after_step=trainer.step)
    return KeptState(trainer.step, values, optim, data, shadow, local_history(trainer))


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as the optimizer slot of `param`: a DTensor laid out like it when it is one."""
    if isinstance(param, DTensor) and local.shape == param.to_local().shape:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    return local


@torch.no_grad()
def _install(trainer: Any, kept: KeptState) -> None:
    params = _params(trainer)
    if len(params) != len(kept.params):
        raise PeerRestoreError(f"{len(kept.params)} parameters kept, {len(params)} built")
    device = trainer.ctx.device
    with masters_in_place(trainer.optimizers):  # into the fp32 masters (bf16 copies follow on exit)
        for p, value in zip(params, kept.params, strict=True):
            _local(p).copy_(value.to(device))
    for shadow, kept_slots in ((False, kept.optim), (True, kept.shadow)):
        holders = _holders(trainer, shadow)
        for opt in holders:
            opt.state.clear()
        owner = {p: opt for opt in holders for g in opt.param_groups for p in g["params"]}
        for p, slots in zip(params, kept_slots, strict=False):  # no shadow kept: nothing to install
            if slots and p in owner:
                owner[p].state[p] = {k: _like(p, v.to(device) if v.dim() else v)
                                     if isinstance(v, torch.Tensor) else v for k, v in slots.items()}
    trainer.data.load_state_dict(kept.data)
    load_local_history(trainer, kept.checks)  # the checks go on from the same "normal"
    trainer.step = kept.step


def load_kept(trainer: Any, kept: KeptState) -> None:
    """A survivor's new Trainer takes the state its previous attempt kept."""
    _install(trainer, kept)


def _meta(kept: KeptState) -> dict[str, Any]:
    """Everything but the tensors' bytes: what the receiver allocates and the plain values."""
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", tuple(v.shape), str(v.dtype).removeprefix("torch."), v.device.type)
        return ("value", v)
    return {"step": kept.step, "data": kept.data, "checks": kept.checks,
            "params": [describe(t) for t in kept.params],
            "optim": [{k: describe(v) for k, v in slots.items()} for slots in kept.optim]}


def _tensors(kept: KeptState) -> list[torch.Tensor]:
    return [*kept.params, *(v for slots in kept.optim for _, v in sorted(slots.items())
                            if isinstance(v, torch.Tensor))]


def send_state(kept: KeptState, dst: int, device: torch.device) -> None:
    """Send this rank's kept state to replacement rank `dst` (global ranks, default group)."""
    dist.send_object_list([_meta(kept)], dst=dst, device=device)
    for t in _tensors(kept):
        dist.send(t.to(device).contiguous(), dst=dst)


def recv_state(trainer: Any, src: int) -> KeptState:
    """Receive a DP peer's state from rank `src` into this (replacement) rank's new Trainer."""
    device = trainer.ctx.device
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=device)
    meta = box[0]

    def alloc(d: Any) -> Any:
        if d[0] != "tensor":
            return d[1]
        _, shape, dtype, kind = d
        return torch.empty(shape, dtype=getattr(torch, dtype), device=device if kind != "cpu" else "cpu")

    params = [alloc(d) for d in meta["params"]]
    optim = [{k: alloc(d) for k, d in slots.items()} for slots in meta["optim"]]
    kept = KeptState(int(meta["step"]), params, optim, dict(meta["data"]),
                     checks=dict(meta.get("checks") or {}))
    for t in _tensors(kept):
        if t.device == device:
            dist.recv(t, src=src)
        else:  # a CPU slot (AdamW's step count) travels through the backend's device
            buf = torch.empty_like(t, device=device)
            dist.recv(buf, src=src)
            t.copy_(buf)
    _install(trainer, kept)
    return kept


def verify(trainer: Any, step: int) -> None:
    """Every DP replica holds the same parameters after the transfer (collective over the world:
    every rank calls it). Raises PeerRestoreError naming the ranks that disagree."""
    divergent = find_divergent_replicas(param_fingerprint(list(trainer.parts)), trainer.dp_group)
    if divergent:
        raise PeerRestoreError(f"DP replicas {divergent} disagree after the peer transfer of step {step}")


def _check_shard_sources(trainer: Any, plan: PeerPlan) -> None:
    """ZeRO-1: a lost rank's shard lives only on the rank that shadows it (the one before it in
    the ZeRO group), so that rank must be its source (workers.recovery_path chooses it so)."""
    for zopt in _sharded(trainer):
        if zopt.shadow is None:
            raise PeerRestoreError("a ZeRO-1 optimizer without shadow shards cannot take a peer's state")
        group = dist.get_process_group_ranks(zopt.process_group)
        pos = group.index(dist.get_rank())
        prev, succ = group[(pos - 1) % len(group)], group[(pos + 1) % len(group)]
        if plan.receive_from not in (None, prev) or any(d != succ for d in plan.send_to):
            raise PeerRestoreError(f"rank {dist.get_rank()}'s ZeRO-1 shard comes from rank {prev} "
                                   f"and it can serve rank {succ} only, not the plan {plan}")


def restore_from_peers(trainer: Any, plan: PeerPlan, kept: KeptState | None) -> int:
    """Run this rank's part of a peer recovery; returns the step training resumes after."""
    device = trainer.ctx.device
    _check_shard_sources(trainer, plan)
    if plan.receive_from is not None:
        kept = recv_state(trainer, plan.receive_from)
    else:
        if kept is None or kept.step != plan.step:
            have = None if kept is None else kept.step
            raise PeerRestoreError(f"rank {dist.get_rank()} kept the state of step {have}, "
                                   f"the plan needs step {plan.step}")
        load_kept(trainer, kept)
        for dst in plan.send_to:
            send_state(kept.for_successor() if _sharded(trainer) else kept, dst, device)
    verify(trainer, plan.step)
    return plan.step
