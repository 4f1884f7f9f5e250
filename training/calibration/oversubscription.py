"""How much slower each process computes when more rank processes than cores share a CPU host.

The embedded cluster runs every rank on the host's own cores: a DP 8 job puts 8 one-thread processes on
2 cores. Dividing the host by the ranks (`Efficiency.share` = ranks x threads / cores) is the ideal; the
processes also evict each other's caches and branch predictors at every switch, which costs a small
matmul ~1.17x and a chain of tiny autograd ops (the demo model's regime) ~1.33x over that ideal at 2-4
processes a core on the 2-core development VM (measured; 1.08-1.12 at one a core). `concurrency`
(engine.py) times two ranks, one a core; this times the levels a job on a CPU node type runs at.

Each level forks `level x cores` copies of this process (cheap: torch is already imported) that run
the same workload for the same number of iterations; the slowdown is their mean seconds per iteration
over (this process alone x processes / cores). Children compute with one thread (the workers give
ranks one, `OMP_NUM_THREADS=1`) and leave with `os._exit`; a child that does not answer within the
timeout is killed and the level is left out.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import struct
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LEVELS = (2, 4)  # processes per core
MAX_PROCS = 32  # a big host is measured at fewer processes per core rather than with hundreds of forks
BUDGET_S = 0.12  # seconds of work per process at each level, as timed alone


def _ops_workload() -> Callable[[], None]:
    """One block-like chain of the demo's sizes (64 tokens, hidden 128): op-bound, forward + backward."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen, requires_grad=True)
    w = torch.randn(128, 128, generator=gen, requires_grad=True)

    def step() -> None:
        y = x
        for _ in range(4):
            y = F.layer_norm(F.gelu(y @ w) + y, (128,))
        y.sum().backward()

    return step


def _matmul_workload() -> Callable[[], None]:
    """A (512, 256) x (256, 1024) matmul: compute-bound on one core."""
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(512, 256, generator=gen), torch.randn(256, 1024, generator=gen)
    return lambda: a @ b


WORKLOADS: dict[str, Callable[[], Callable[[], None]]] = {"ops": _ops_workload, "matmul": _matmul_workload}


def _per_iter(fn: Callable[[], None], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _together(fn: Callable[[], None], iters: int, procs: int, timeout_s: float) -> float | None:
    """Mean seconds per iteration of `procs` processes (this one and procs - 1 forks) running `fn` at
    once; None if a child did not answer in time."""
    read_fd, write_fd = os.pipe()
    children: list[int] = []
    try:
        for _ in range(procs - 1):
            pid = os.fork()
            if pid == 0:  # the child: compute, report, leave without running the parent's exit handlers
                code = 1
                try:
                    os.close(read_fd)
                    torch.set_num_threads(1)
                    os.write(write_fd, struct.pack("d", _per_iter(fn, iters)))
                    code = 0
                finally:
                    os._exit(code)
            children.append(pid)
        os.close(write_fd)
        write_fd = -1
        times = [_per_iter(fn, iters)]
        buf, deadline = b"", time.monotonic() + timeout_s
        while len(buf) < 8 * len(children):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                return None
            chunk = os.read(read_fd, 8 * len(children) - len(buf))
            if not chunk:
                return None  # a child died without reporting
            buf += chunk
        times += [t for (t,) in struct.iter_unpack("d", buf)]
        return sum(times) / len(times)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def measure_oversubscription(
    cores: int | None = None, levels: Sequence[int] = LEVELS, budget_s: float = BUDGET_S,
    workloads: Sequence[str] = tuple(WORKLOADS), timeout_s: float = 30.0,
) -> dict[str, list[tuple[float, float]]]:
    """workload -> [(processes per core, slowdown over the ideal share)], slowdowns >= 1. Measured
    with one compute thread (restored after)."""
    cores = cores or os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[str, list[tuple[float, float]]] = {}
    try:
        for name in workloads:
            fn = WORKLOADS[name]()
            for _ in range(3):
                fn()
            alone = _per_iter(fn, 3)
            iters = max(3, int(budget_s / max(alone, 1e-6)))
            alone = _per_iter(fn, iters)
            points = []
            for level in levels:
                procs = min(MAX_PROCS, level * cores)
                together = _together(fn, iters, procs, timeout_s)
                if together is None:
                    log.warning("oversubscription: %s at %d processes did not finish; left out", name, procs)
                    continue
                ideal = alone * max(1.0, procs / cores)
                points.append((procs / cores, round(max(1.0, together / ideal), 4)))
            out[name] = points
    finally:
        torch.set_num_threads(threads)
    return out
