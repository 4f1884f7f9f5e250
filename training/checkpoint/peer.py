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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from training.integrity.fingerprint import find_divergent_replicas, param_fingerprint
from training.parallel.precision import masters_in_place, plain_optimizer


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

    @property
    def nbytes(self) -> int:
        tensors = [*self.params, *(v for slots in self.optim for v in slots.values()
                                   if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)


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


def _slots(trainer: Any) -> dict[torch.nn.Parameter, dict[str, Any]]:
    """Each parameter's optimizer state (exp_avg, exp_avg_sq, step for AdamW)."""
    out: dict[torch.nn.Parameter, dict[str, Any]] = {}
    for opt in trainer.optimizers:
        out.update(plain_optimizer(opt).state)
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
    slots = _slots(trainer)
    params = _params(trainer)
    optim = [{k: _local(v).detach() if isinstance(v, torch.Tensor) else v
              for k, v in slots.get(p, {}).items()} for p in params]
    with masters_in_place(trainer.optimizers):  # a bf16 run keeps its fp32 masters, not the copies
        values = [_local(p).detach() for p in params]
    return KeptState(trainer.step, values, optim, dict(trainer.data.state_dict()))


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
    for opt in trainer.optimizers:
        plain_optimizer(opt).state.clear()
    owner = {p: plain_optimizer(opt) for opt in trainer.optimizers
             for g in plain_optimizer(opt).param_groups for p in g["params"]}
    device = trainer.ctx.device
    with masters_in_place(trainer.optimizers):  # into the fp32 masters (bf16 copies follow on exit)
        for p, value in zip(params, kept.params, strict=True):
            _local(p).copy_(value.to(device))
    for p, slots in zip(params, kept.optim, strict=True):
        if slots and p in owner:
            owner[p].state[p] = {k: _like(p, v.to(device) if v.dim() else v) if isinstance(v, torch.Tensor)
                                 else v for k, v in slots.items()}
    trainer.data.load_state_dict(kept.data)
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
    return {"step": kept.step, "data": kept.data,
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
    kept = KeptState(int(meta["step"]), params, optim, dict(meta["data"]))
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


def restore_from_peers(trainer: Any, plan: PeerPlan, kept: KeptState | None) -> int:
    """Run this rank's part of a peer recovery; returns the step training resumes after."""
    device = trainer.ctx.device
    if plan.receive_from is not None:
        kept = recv_state(trainer, plan.receive_from)
    else:
        if kept is None or kept.step != plan.step:
            have = None if kept is None else kept.step
            raise PeerRestoreError(f"rank {dist.get_rank()} kept the state of step {have}, "
                                   f"the plan needs step {plan.step}")
        load_kept(trainer, kept)
        for dst in plan.send_to:
            send_state(kept, dst, device)
    verify(trainer, plan.step)
    return plan.step
