"""Run a function on N ranks of this machine, one spawned process each, and collect what they return.

    results = run_local_ranks(4, fn, (config,))   # [rank 0's result, rank 1's, ...]

`fn(rank, world, *args)` must be a module-level function (pickled by name into the spawned processes);
the process group is initialised before it runs, on a free port: NCCL with one GPU per rank when CUDA
has enough devices, gloo otherwise (or the `backend` asked for). Each rank gets `threads` intra-op
threads (default: the cores shared out). Return plain Python values: a tensor would travel through
shared memory that dies with its process. A failure on any rank raises `LocalRankError` with that
rank's traceback. The benchmarks and `lattice calibrate`'s collective measurements use it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

from training.parallel.dist import free_port


class LocalRankError(RuntimeError):
    pass


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, queue: Any,
           backend: str | None, threads: int, init_timeout_s: float) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch

    torch.set_num_threads(threads)
    from training.parallel.dist import default_backend, init_distributed, shutdown

    chosen = backend or default_backend()
    if chosen == "nccl" and torch.cuda.device_count() < world:
        chosen = "gloo"  # NCCL needs a GPU per rank
    try:
        init_distributed(rank, world, "127.0.0.1", port, backend=chosen, timeout_s=init_timeout_s)
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the result is already reported
            pass


def run_local_ranks(world: int, fn: Callable[..., Any], args: tuple = (), *, backend: str | None = None,
                    threads: int | None = None, timeout_s: float = 1200.0,
                    init_timeout_s: float = 600.0) -> list[Any]:
    """Every rank's return value, in rank order (see the module docstring)."""
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, queue, backend, threads,
                                              init_timeout_s)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, payload = queue.get(timeout=timeout_s)
            if not ok:
                raise LocalRankError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
