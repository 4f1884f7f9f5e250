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
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

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


def supported(layout: Layout) -> bool:
    return layout.dp > 1 and layout.zero_stage <= 1 and layout.ep == 1


def probe(trainer: Any, step: int) -> dict[int, tuple[float, float]]:
    """Every rank's (norm of its batch's local gradient as it computed it, as its DP predecessor
    did), on every rank. A collective: every rank calls it, from the pre-step parameters."""
    dims, layout = trainer.dims, trainer.cfg.layout
    own = _batch_norm(trainer, step, dims.dp_rank)
    peer = _batch_norm(trainer, step, (dims.dp_rank + 1) % dims.dp_size)
    gathered = gather_object((own, peer))
    out = {}
    for r, (mine, _) in enumerate(gathered):
        c = layout.coord(r)
        before = layout.rank_of(c.pp, (c.dp - 1) % layout.dp, c.cp, c.tp)
        out[r] = (mine, gathered[before][1])
    return out


def follows_data(result: Probe, ranks: Collection[int]) -> bool:
    """Each of `ranks`' batches gave the same gradient norm on its DP predecessor as on itself."""
    return all(_same(*result[r]) for r in ranks)


def evidence(result: Probe, ranks: Collection[int]) -> dict[str, Any]:
    return {"follows_data": follows_data(result, ranks),
            "norms": {str(r): {"own": json_number(result[r][0]), "peer": json_number(result[r][1])}
                      for r in sorted(ranks)}}




def _same(a: float, b: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):  # a batch whose gradient overflows on any device
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


def _batch_norm(trainer: Any, step: int, dp_rank: int) -> float:
    """The L2 norm of this rank's local gradient of DP rank `dp_rank`'s batch at `step`; the
    gradients are dropped after (the parameters and the optimizer are not touched)."""
    layout, device = trainer.cfg.layout, trainer.ctx.device
    inputs, targets = trainer.data.batch(step, dp_rank, layout.dp)
    inputs, targets = inputs.to(device), targets.to(device)
    injector = trainer.hooks.injector
    if injector is not None:  # an injected faulty device corrupts whatever it computes at this step
        injector.arm_grad_flips(step, trainer.named_parameters())
    with no_grad_sync(trainer.modules):
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
    return math.sqrt(total)
