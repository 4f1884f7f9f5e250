"""Whose is a reproduced gradient spike: the batch's or the named rank's device's (the swap probe).

A statistical gradient check (training.integrity.rerun.STATISTICAL_KINDS) that a re-run on the same
rank reproduces to the bit is either the data's (an odd micro-batch) or a persistent fault of that
rank's device (it corrupts the step each time it computes it). Only other hardware tells them apart,
and a DP peer is other hardware with the same parameters: from the pre-step parameters every rank
computes the local gradient of its own micro-batches and of its next DP peer's (no reduction, no
optimizer step), so each rank's batch is computed twice, by itself and by its DP predecessor. The
same norm (to rounding: another process may sum in another order) follows the data; a norm that
changes with the device is the named rank's device's, however often that device reproduces it.

Applies with DP >= 2 and replicated parameters whose local gradient depends on the batch alone
(ZeRO <= 1, no expert parallelism); elsewhere a reproduced spike stays the data's.

Under PP a faulty device's error crosses stage boundaries: a corrupt activation gradient it sends
upstream makes the *healthy* earlier stages' gradients spike, a corrupt activation every later
stage's. So the probe also measures, per stage, what crossed its boundaries (the activation it
received and sent, the gradient it received and sent) and `culprits` names the stage where the
difference between the two pipelines begins: the first whose input agrees but whose output does
not (forward), else the last whose received gradient agrees but whose own or sent gradient does
not (backward). Without that, every spiking stage of the replica was named.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from training.config.layout import Layout
from training.integrity.detectors import json_number
from training.parallel.dist import gather_object
from training.parallel.optim import no_grad_sync
from training.parallel.wrapping import local_tensor

# Relative difference below which two norms of one batch's gradient are the same computation. A
# spike check fires at a factor of several; a fault that trips one changes the norm far more.
RTOL = 1e-4

Probe = Mapping[int, tuple[float, float]]  # rank -> (its batch's norm on itself, on its DP predecessor)


class Boundary(NamedTuple):
    """L2 norms of what crossed a pipeline stage's boundaries for one batch (all micro-batches)."""

    act_in: float = 0.0  # the activation it received (0: the first stage's token ids)
    act_out: float = 0.0  # the activation (or logits) it produced
    grad_in: float = 0.0  # the gradient it received for its output
    grad_out: float = 0.0  # the gradient it sent for its input (0: the first stage)


Boundaries = Mapping[int, tuple[Boundary, Boundary]]  # rank -> (as it computed them, as its predecessor did)


class SwapProbe(dict[int, tuple[float, float]]):
    """`Probe` (rank -> (own norm, the DP predecessor's norm of the same batch)) and, under PP, each
    rank's stage boundaries for its batch: rank -> (as it computed them, as its predecessor did)."""

    def __init__(self, norms: Probe, boundaries: Boundaries) -> None:
        super().__init__(norms)
        self.boundaries = dict(boundaries)


def supported(layout: Layout) -> bool:
    return layout.dp > 1 and layout.zero_stage <= 1 and layout.ep == 1


def probe(trainer: Any, step: int) -> SwapProbe:
    """Every rank's (norm of its batch's local gradient as it computed it, as its DP predecessor
    did), on every rank. A collective: every rank calls it, from the pre-step parameters."""
    dims, layout = trainer.dims, trainer.cfg.layout
    own = _batch_norm(trainer, step, dims.dp_rank)
    peer = _batch_norm(trainer, step, (dims.dp_rank + 1) % dims.dp_size)
    gathered = gather_object((own, peer))  # per rank: ((norm, boundary), (norm, boundary))
    norms, boundaries = {}, {}
    for r, ((mine, mine_at), _) in enumerate(gathered):
        c = layout.coord(r)
        theirs, theirs_at = gathered[layout.rank_of(c.pp, (c.dp - 1) % layout.dp, c.cp, c.tp)][1]
        norms[r] = (mine, theirs)
        if mine_at is not None and theirs_at is not None:
            boundaries[r] = (mine_at, theirs_at)
    return SwapProbe(norms, boundaries)


def culprits(result: SwapProbe, spiked: Collection[int], layout: Layout) -> list[int]:
    """The ranks whose devices a swap probe that did not follow the data names: each spiked rank
    whose batch gave another norm on its peer's device; under PP, instead, the stage of its pipeline
    where the two pipelines' boundaries start to differ (see the module's docstring)."""
    differing = sorted(r for r in spiked if not _same(*result[r]))
    boundaries = result.boundaries
    named: set[int] = set()
    for r in differing:
        c = layout.coord(r)
        chain = [layout.rank_of(pp, c.dp, c.cp, c.tp) for pp in range(layout.pp)]
        stage = _origin(chain, result, boundaries) if all(s in boundaries for s in chain) else None
        named.add(r if stage is None else chain[stage])
    return sorted(named)


def _origin(chain: list[int], result: Probe, boundaries: Boundaries) -> int | None:
    """The stage of `chain` (one pipeline's ranks, stage order) where its results first depart from
    the predecessor pipeline's on the same batch; None when no stage's boundaries tell."""
    def differs(rank: int, field: str) -> bool:
        own, peer = boundaries[rank]
        return not _same(getattr(own, field), getattr(peer, field))

    for stage, rank in enumerate(chain):  # forward: the first stage fed alike that answers otherwise
        if not differs(rank, "act_in") and differs(rank, "act_out"):
            return stage
    for stage in reversed(range(len(chain))):  # backward: the last stage whose gradient went wrong
        rank = chain[stage]
        if not differs(rank, "grad_in") and (differs(rank, "grad_out") or not _same(*result[rank])):
            return stage
    return None


def follows_data(result: Probe, ranks: Collection[int]) -> bool:
    """Each of `ranks`' batches gave the same gradient norm on its DP predecessor as on itself."""
    return all(_same(*result[r]) for r in ranks)


def evidence(result: SwapProbe, ranks: Collection[int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "follows_data": follows_data(result, ranks),
        "norms": {str(r): {"own": json_number(result[r][0]), "peer": json_number(result[r][1])}
                  for r in sorted(ranks)}}
    parted = {str(r): {"own": [json_number(v) for v in own], "peer": [json_number(v) for v in peer]}
              for r, (own, peer) in sorted(result.boundaries.items())
              if not all(_same(a, b) for a, b in zip(own, peer, strict=True))}
    if parted:  # under PP: the stages whose boundaries differed between the two pipelines
        out["boundaries"], out["boundary_fields"] = parted, list(Boundary._fields)
    return out


def _same(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):  # a batch whose gradient overflows on any device
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


@contextmanager
def _boundaries(trainer: Any) -> Iterator[list[float] | None]:
    """Sums of squares of what crosses this rank's pipeline stage while the block runs (act_in,
    act_out, grad_in, grad_out, as Boundary); None where a rank holds no single stage (no PP, or
    virtual stages)."""
    if trainer.pipeline is None or len(trainer.modules) != 1:
        yield None
        return
    sums = [0.0, 0.0, 0.0, 0.0]

    def add(i: int, t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            sums[i] += float(local_tensor(t.detach()).double().square().sum())

    def grad_hook(i: int) -> Any:
        return lambda g: add(i, g)

    def before(_module: Any, args: tuple) -> None:
        for t in args:
            add(0, t)
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(grad_hook(3))

    def after(_module: Any, _args: tuple, out: Any) -> None:
        add(1, out)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(grad_hook(2))

    module = trainer.modules[0]
    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield sums
    finally:
        for h in handles:
            h.remove()


def _batch_norm(trainer: Any, step: int, dp_rank: int) -> tuple[float, Boundary | None]:
    """The L2 norm of this rank's local gradient of DP rank `dp_rank`'s batch at `step`, and under PP
    what crossed its stage's boundaries; the gradients are dropped after (the parameters and the
    optimizer are not touched)."""
    layout, device = trainer.cfg.layout, trainer.ctx.device
    inputs, targets = trainer.data.batch(step, dp_rank, layout.dp)
    inputs, targets = inputs.to(device), targets.to(device)
    injector = trainer.hooks.injector
    if injector is not None:  # an injected faulty device corrupts whatever it computes at this step
        injector.arm_grad_flips(step, trainer.named_parameters())
    with no_grad_sync(trainer.modules), _boundaries(trainer) as crossed:
        if trainer.pipeline is not None:
            trainer.pipeline.step(inputs, targets)
        else:
            n = layout.num_microbatches
            for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
                (trainer.parts[0].loss(trainer.modules[0](x), y) / n).backward()
    with torch.no_grad():
        total = sum(float(local_tensor(p.grad).double().square().sum())
                    for _, p in trainer.named_parameters() if p.grad is not None)
        for _, p in trainer.named_parameters():
            p.grad = None
    if trainer.abft is not None:
        trainer.abft.discard()
    return math.sqrt(total), None if crossed is None else Boundary(*(math.sqrt(v) for v in crossed))
