"""Stand-in train functions for the Ray tests: the engine's signature, a real gloo all-reduce per
step, and no model, so that a test can hold ranks busy cheaply (e.g. to cancel them)."""

from __future__ import annotations

import hashlib
import time
from typing import Any


def allreduce_train(ctx: Any, cfg: Any, hooks: Any = None, *, resume: bool = True,
                    flops_per_token: float | None = None) -> Any:
    import torch
    import torch.distributed as dist

    from training.train import StepInfo, TrainResult

    x = torch.full((4,), float(ctx.rank + 1))
    losses = []
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        x /= ctx.world_size
        time.sleep(0.05)
        loss = 1.0 / step
        losses.append(loss)
        if hooks is not None:
            hooks.on_step(StepInfo(step, loss, 1.0, time.perf_counter() - t0, None, [step]))
    digest = hashlib.sha256(repr(x.tolist()).encode()).hexdigest()
    return TrainResult(final_step=cfg.steps, losses=losses, model_digest=digest)
