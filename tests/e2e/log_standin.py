"""A train function for the logs test: every rank prints a marker, logs one and writes one to fd 2,
then trains like the stand-in all-reduce; with seed FAILING_SEED rank 1 raises instead (a job whose
training raises)."""

from __future__ import annotations

import logging
import os
from typing import Any

from tests.workers.standin import allreduce_train

FAILING_SEED = 13


def chatty_train(ctx: Any, cfg: Any, hooks: Any = None, *, resume: bool = True,
                 flops_per_token: float | None = None) -> Any:
    print(f"stdout-marker rank={ctx.rank} seed={cfg.seed}", flush=True)
    logging.getLogger("tests.chatty").info("logging-marker rank=%d", ctx.rank)
    os.write(2, f"native-marker rank={ctx.rank}\n".encode())  # straight to fd 2, as C++ code writes
    if cfg.seed == FAILING_SEED and ctx.rank == 1:
        raise RuntimeError(f"chatty rank {ctx.rank} gives up before its first step")
    return allreduce_train(ctx, cfg, hooks, resume=resume, flops_per_token=flops_per_token)
