"""Run a function on N real gloo ranks (one process each) and collect what each returns.

    results = run_ranks(world_size=4, fn=_worker, args=(config,))

`fn(rank, world_size, *args)` must be a module-level function (it is pickled by name into
spawned processes). The process group is initialised before `fn` runs, on a free port.
A failure on any rank raises `RankFailed` with that rank's traceback, and so does a rank process
that exits non-zero after returning its result (an abort at interpreter exit). Return plain Python
values (lists, floats, strings), not tensors: a tensor travels through shared memory that dies
with the rank process before the parent reads it.

The rank processes are forked from a forkserver that has imported torch and the engine once per
test session (`start_method="forkserver"`, the default): a rank starts in ~0.1 s instead of the
~2 s of a spawned interpreter importing torch, which a few hundred rank processes in `make test` pay
otherwise. Each rank gets the caller's environment as it is at the call, as a spawned one would.
Such a rank leaves with `os._exit` after its finalizers, without the interpreter's shutdown, so a
test about what happens at interpreter exit asks for `start_method="spawn"` (tests/training/test_exit.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

from training.parallel.dist import free_port


class RankFailed(AssertionError):
    pass


# Imported by the forkserver before it forks any rank: what every rank would import anyway.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "training.parallel.dist",
            "training.train", "training.checkpoint.checkpointer", "training.parallel.pipeline"]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, queue: Any,
           env: dict[str, str]) -> None:
    os.environ.clear()  # a forked rank inherits the forkserver's environment: use the caller's
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from training.parallel.dist import init_distributed, shutdown

    try:
        init_distributed(rank, world, "127.0.0.1", port, backend="gloo", timeout_s=180)
        result = fn(rank, world, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001
            pass


def _context(start_method: str) -> Any:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the session's first call)
    return ctx


def run_ranks(
    world_size: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = 300.0,
    start_method: str = "forkserver",
) -> list[Any]:
    ctx = _context(start_method)
    env = dict(os.environ)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, env), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout_s)
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        raise RankFailed(f"rank {rank} failed:\n{errors[rank]}")
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes):
        raise RankFailed(f"rank processes exited with {codes} after returning their results")
    return [results[r] for r in range(world_size)]


def train_to_integrity_error(rank: int, world: int, cfg: Any, hooks: Any, *, resume: bool) -> dict[str, Any]:
    """Train `cfg` on this gloo rank with `hooks`, whose integrity errors end the attempt as the Ray
    ranks' do; {kind, step, ranks, evidence} of the error, or {} when training ended without one."""
    import torch

    from training.integrity.detectors import IntegrityError
    from training.parallel.dist import DistContext
    from training.train import train

    def fail(error: Any) -> None:
        raise error

    hooks.on_integrity_error = fail
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    try:
        train(ctx, cfg, hooks, resume=resume)
    except IntegrityError as e:
        return {"kind": e.kind, "step": e.step, "ranks": e.ranks, "evidence": e.evidence}
    return {}
