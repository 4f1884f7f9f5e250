"""A referee for two data-parallel replicas that disagree persistently (a 1-1 vote that the re-run repeats).

With DP = 2, a fingerprint mismatch has no majority, and re-running the step from the pre-step
snapshot tells a transient fault (the re-run agrees) from a persistent one (it disagrees again),
but not which replica is wrong: each re-runs on its own, possibly faulty, hardware. A third
party decides: a spare process on a healthy node loads the pre-step snapshot one replica wrote
(`save_referee_snapshot` of a `StepSnapshot.state()`), replays the whole data-parallel step
alone (`replay_step`: both replicas' slices one after the other, their gradients summed and
averaged as the all-reduce does, the same clipping and optimizer step) and fingerprints the
result. The replica whose fingerprint equals the referee's computed the step correctly; the
other is the culprit. Matching is exact, so a referee that cannot reproduce the step bit for
bit names nobody (`verdict`).

Scope: the replica must be the whole model on one rank (tp = pp = cp = 1, ZeRO-0: what the
pre-step snapshot covers), and two replicas, whose sum the all-reduce computes in one addition.
Pure torch, one process, no collectives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from training.config.layout import Layout
from training.config.run import RunConfig
from training.data.sources import make_data_source
from training.integrity.attribution import load_optimizer_state
from training.integrity.fingerprint import param_fingerprint
from training.model.transformer import Transformer
from training.parallel.optim import build_optimizer, clip_grad_norm

log = logging.getLogger(__name__)

REFEREE_DIR = "referee"


def referee_supported(layout: Layout) -> bool:
    """Layouts whose DP step one process can replay bit for bit from a rank's snapshot."""
    return (layout.dp == 2 and layout.tp == 1 and layout.pp == 1 and layout.cp == 1
            and layout.zero_stage == 0 and getattr(layout, "ep", 1) == 1)


def referee_snapshot_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, REFEREE_DIR, f"step-{step}.pt")


def save_referee_snapshot(path: str, state: Mapping[str, Any]) -> str:
    """Write a pre-step `StepSnapshot.state()` (parameters, optimizer state, RNG) atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save({"step": int(state["step"]), "params": [p.detach().cpu() for p in state["params"]],
                "optim": [dict(s) for s in state["optim"]], "rng": state["rng"]}, tmp)
    os.replace(tmp, path)
    return path


def replay_step(cfg: RunConfig, snapshot_path: str) -> dict[str, Any]:
    """Replay the snapshot's step of a DP = 2 job in this process; returns the fingerprint (hex)
    of the parameters after the step, as every healthy replica must have them."""
    layout = cfg.layout
    if not referee_supported(layout):
        raise ValueError(f"the referee replays dp=2 with tp=pp=cp=1 and ZeRO-0 only, got {layout.describe()}")
    snap = torch.load(snapshot_path, weights_only=False)
    step, dp, n = int(snap["step"]), layout.dp, layout.num_microbatches
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    params = list(model.parameters())
    with torch.no_grad():
        for p, saved in zip(params, snap["params"], strict=True):
            p.copy_(saved)
    data = make_data_source(cfg.data, cfg.model, cfg.global_batch)  # a step's samples depend on the step only
    total: list[torch.Tensor | None] = [None] * len(params)
    for r in range(dp):  # each replica's forward and backward, as Trainer.forward_backward does them
        if snap.get("rng") is not None:
            torch.set_rng_state(snap["rng"])
        for p in params:
            p.grad = None
        inputs, targets = data.batch(step, r, dp)
        for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
            (model.loss(model(x), y) / n).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
    for p, g in zip(params, total, strict=True):  # the all-reduce's sum, then DDP's division
        p.grad = None if g is None else g.div_(dp)
    if cfg.optim.grad_clip:
        clip_grad_norm([model], cfg.optim.grad_clip, None)
    opt = build_optimizer([model], Layout(), cfg, None)
    (saved_state,) = snap["optim"]
    load_optimizer_state(opt, saved_state)
    opt.step()
    fingerprint = f"{param_fingerprint([model]):032x}"
    log.info("referee replayed step %d: fingerprint %s", step, fingerprint)
    return {"step": step, "fingerprint": fingerprint}


def verdict(replica_fingerprints: Mapping[int, str], referee_fingerprint: str) -> tuple[list[int], list[int]]:
    """(culprits, healthy): the replicas whose fingerprint differs from / equals the referee's.
    Exactly one match names the other replica(s); no match (or all) names nobody."""
    healthy = sorted(r for r, f in replica_fingerprints.items() if f == referee_fingerprint)
    if len(healthy) != 1 or len(replica_fingerprints) < 2:
        return [], healthy
    return sorted(r for r in replica_fingerprints if r not in healthy), healthy
