"""Importing the training engine from a rank or the controller: `train_fn` paths
('package.module:function') and warming the slow imports (torch, the engine) in the background."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a rank (and the controller, for checkpoint scrubbing) imports before its first use: torch
# and the engine take seconds to import, which a replacement rank or the first scrub would
# otherwise spend on the recovery path.
WARM_MODULES = ("torch", "torch.distributed.checkpoint", "training.checkpoint.checkpointer", "training.train")
# Ray's worker setup hook for rank actors (workers.warm_workers): a worker process runs it at its start.
SETUP_HOOK = "workers.engine_imports.preload"
process_started_at: float | None = None  # set by the hook: when this process was created (None: no hook)


def preload() -> None:
    """Import WARM_MODULES now (a new rank worker process, before it takes an actor)."""
    global process_started_at
    process_started_at = process_start_time()
    warm_imports().join()


def process_start_time() -> float:
    """When this process was created (wall clock, ~10 ms): its age from /proc (Linux), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def warm_imports(modules: tuple[str, ...] = WARM_MODULES,
                 on_done: Callable[[], None] | None = None) -> threading.Thread:
    """Import `modules` in a background thread (the import lock makes a later import wait for it);
    `on_done` runs in it once they are all imported (or failed to)."""

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - the real import will report it
                log.debug("warm import of %s failed: %s", name, e)
        if on_done is not None:
            on_done()

    thread = threading.Thread(target=run, name="lattice-warm-imports", daemon=True)
    thread.start()
    return thread


def import_callable(path: str) -> Callable[..., Any]:
    """'package.module:function' -> the function."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"train_fn must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)
