"""Importing the training engine from a rank or the controller: `train_fn` paths
('package.module:function') and warming the slow imports (torch, the engine) in the background."""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What a rank (and the controller, for checkpoint scrubbing) imports before its first use: torch
# and the engine take seconds to import, which a replacement rank or the first scrub would
# otherwise spend on the recovery path.
WARM_MODULES = ("torch", "torch.distributed.checkpoint", "training.checkpoint.checkpointer", "training.train")
# What only pipeline-parallel ranks import (training.train imports it for pp > 1): torch's pipelining
# brings torch._dynamo, ~0.7 s of a core (a fifth of the engine's imports). The processes of a job with
# pipeline stages import it ahead of need, so that a replacement joining a pipeline does not import it
# on the recovery path; those of a job without (`rank_env`: its ranks and its warm processes) do not:
# every one of them would pay it, and on the 2-core embedded cluster the job's first steps with it. A
# hot spare does whatever its job's layout (workers.rank.RankActor.ready: it may join a replanned one).
PIPELINE_MODULES = ("training.parallel.pipeline",)
PRELOAD_PIPELINE_ENV = "LATTICE_PRELOAD_PIPELINE"  # "0" in the rank env of a job without pipeline stages
# Ray's worker setup hook for rank actors (workers.warm_workers): a worker process runs it at its start.
SETUP_HOOK = "workers.engine_imports.preload"
process_started_at: float | None = None  # set by the hook: when this process was created (None: no hook)
_preloading: threading.Thread | None = None  # the hook's imports
_idle_threads: set[int] = set()  # native ids of import threads put under SCHED_IDLE (until `claim`)
CAP_SYS_NICE = 23  # linux/capability.h


def preload() -> None:
    """Ray's setup hook of a rank worker process: import WARM_MODULES, and PIPELINE_MODULES unless its
    job has no pipeline stages (`rank_env`), in the background, at idle CPU priority until an actor
    claims the process (`claim`). A warm process that waits for work (a replacement's,
    workers.warm_workers) thus never takes a core from ranks computing on the same host, as ten of
    them importing torch did from a job on the 2-core embedded cluster (2-4x slower steps for its
    first ~40 s); on a GPU node, whose host cores are mostly idle, it is warm as soon."""
    global process_started_at, _preloading
    process_started_at = process_start_time()
    pipeline = PIPELINE_MODULES if os.environ.get(PRELOAD_PIPELINE_ENV, "1") != "0" else ()
    _preloading = warm_imports(WARM_MODULES + pipeline, idle=may_raise_priority())


def rank_env(env_vars: Mapping[str, str], pp: int) -> dict[str, str]:
    """The environment of a job's rank processes: `env_vars`, and whether `preload` imports the
    pipeline engine (only for a layout with pipeline stages)."""
    return {**env_vars, PRELOAD_PIPELINE_ENV: "1" if pp > 1 else "0"}


def claim() -> None:
    """This process was given an actor: the preload still running, if any, at normal priority from now
    (its imports are the actor's first wait). Nothing to undo where the hook never set idle priority
    (no permission to undo it, or not Linux)."""
    thread = _preloading
    if thread is None or thread.native_id not in _idle_threads:
        return
    _idle_threads.discard(thread.native_id)
    if thread.is_alive():
        _set_policy(thread.native_id, os.SCHED_OTHER)


def may_raise_priority() -> bool:
    """Whether this process may undo SCHED_IDLE: CAP_SYS_NICE, or an RLIMIT_NICE that covers its
    nice value (sched(7)). Without it, idle priority would last the imports out, so none is set."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
        if soft == resource.RLIM_INFINITY or soft >= 20 - os.getpriority(os.PRIO_PROCESS, 0):
            return True
        status = Path("/proc/self/status").read_text().splitlines()
        cap_eff = int(next(line for line in status if line.startswith("CapEff:")).split()[1], 16)
        return bool(cap_eff >> CAP_SYS_NICE & 1)
    except (OSError, ValueError, StopIteration):
        return False


def _set_policy(tid: int, policy: int) -> bool:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except OSError as e:  # the thread ended meanwhile, or no permission: the imports go on as they are
        log.debug("scheduling policy %d for thread %d: %s", policy, tid, e)
        return False


def process_start_time() -> float:
    """When this process was created (wall clock, ~10 ms): its age from /proc (Linux), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def warm_imports(modules: tuple[str, ...] = WARM_MODULES,
                 on_done: Callable[[], None] | None = None, *, idle: bool = False) -> threading.Thread:
    """Import `modules` in a background thread (the import lock makes a later import wait for it);
    `on_done` runs in it once they are all imported (or failed to). `idle`: the thread runs under
    SCHED_IDLE (only when no other thread wants the CPU) until `claim`."""

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
    if idle and thread.native_id is not None:  # set here, not in the thread: `claim` comes after it
        if _set_policy(thread.native_id, os.SCHED_IDLE):
            _idle_threads.add(thread.native_id)
    return thread


def import_callable(path: str) -> Callable[..., Any]:
    """'package.module:function' -> the function."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"train_fn must look like 'package.module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)
