"""The measurements of a hardware profile (compute on this process's device, collectives on 2 ranks:
local ones, and one on each of two nodes for the inter-node tier).

Every figure is the median of a few timed repeats after one warm-up, except the fixed cost per op: the
mean of windows spread over the calibration (OpOverheadSampler). GPU timings synchronise the device
around each repeat.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from training.calibration.oversubscription import measure_oversubscription
from training.parallel.dist import default_device
from training.parallel.local_ranks import LocalRankError, run_local_ranks

log = logging.getLogger(__name__)

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")


@dataclass(frozen=True)
class Grid:
    """What to measure: matmul sizes (m = n = k, plus the transformer-like (s, h, 4h) shapes), attention
    sequence lengths and head dims, collective message sizes, and the repeats of each."""

    matmul_sizes: Sequence[int] = (64, 128, 256, 512, 1024, 2048)
    attention_seqs: Sequence[int] = (64, 128, 256, 512, 1024)
    head_dims: Sequence[int] = (16, 64, 128)
    message_bytes: Sequence[int] = (4 << 10, 256 << 10, 4 << 20)
    copy_bytes: int = 64 << 20
    repeats: int = 3
    # A call shorter than this many seconds / repeats is timed more often (up to SHORT_REPEATS x
    # repeats): at the demo's sizes the medians of 3 moved predictions by +-15% between calibrations.
    short_budget_s: float = 0.06
    collectives: bool = True
    engine_points: int = 2  # with the collectives on CPU: sizes of the engine's TP / FSDP2 costs (engine.py)
    attention_heads: int = 4
    flops_per_timing: float = 2e9  # on CUDA, matmuls queued per timing until about this many FLOPs

    @classmethod
    def for_device(cls, device: torch.device) -> Grid:
        """The grid a node type is calibrated with: the default on CPU; on CUDA the shapes a training
        step runs (matmuls up to 8192, attention to 8192 tokens with 32 heads, messages to 256 MiB,
        a 1 GiB copy), each timing long enough (~0.3 ms of queued matmuls) that launches don't count."""
        if device.type != "cuda":
            return cls()
        return cls(matmul_sizes=(512, 1024, 2048, 4096, 8192), attention_seqs=(512, 1024, 2048, 4096, 8192),
                   head_dims=(64, 128), message_bytes=(1 << 20, 16 << 20, 256 << 20), copy_bytes=1 << 30,
                   repeats=5, short_budget_s=0.02, attention_heads=32, flops_per_timing=2e11)  # fmt: skip

    @classmethod
    def quick(cls) -> Grid:
        """A reduced grid (a second or two without collectives): the scheduler's background calibration
        of a node type, and tests. Its messages still reach 4 MiB: at 4 and 64 KiB alone every
        all-reduce is latency, and the bandwidth fitted to two such points ranged 0.04-2.2 GB/s."""
        return cls(matmul_sizes=(32, 64, 128), attention_seqs=(64, 128), head_dims=(32,),
                   message_bytes=(4 << 10, 256 << 10, 4 << 20), copy_bytes=4 << 20, repeats=2,
                   short_budget_s=0.0, engine_points=1)  # fmt: skip


SHORT_REPEATS = 5  # at most this many times the grid's repeats for a short call
# Collectives of at most this many bytes are timed SHORT_REPEATS x as often: a small gloo all-reduce
# between processes sharing cores took 0.2 or 2 ms by turns, and the median of 2 was either.
SMALL_MESSAGE_BYTES = 1 << 20


def _best_time(fn: Callable[[], Any], device: torch.device, repeats: int, budget_s: float = 0.0) -> float:
    """Median seconds of `repeats` timed calls after one warm-up: on a shared host the median is what a
    rank gets; the minimum would keep only the quiet moments. With `budget_s`, a call whose warm-up
    took less than `budget_s / repeats` is timed as often as fits in `budget_s` (at most SHORT_REPEATS x
    `repeats`): a median of more short timings moves less between calibrations."""
    t0 = time.perf_counter()
    fn()  # warm-up (allocations, kernel selection)
    warm = time.perf_counter() - t0
    n = max(1, repeats)
    if budget_s > 0:
        n = max(n, min(SHORT_REPEATS * n, int(budget_s / max(warm, 1e-6))))
    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _dtypes(device: torch.device) -> list[tuple[str, torch.dtype]]:
    out = [("fp32", torch.float32)]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        out.append(("bf16", torch.bfloat16))
    return out


def measure_matmul(grid: Grid, device: torch.device) -> dict[str, list[list[float]]]:
    """dtype -> [(m, n, k, achieved FLOP/s)] over square sizes and (s, h, 4h)-like rectangles."""
    gen = torch.Generator(device=device).manual_seed(0)  # drawn on the device: no host randn, no copy
    shapes = [(s, s, s) for s in grid.matmul_sizes]
    shapes += [(2 * s, 4 * s, s) for s in grid.matmul_sizes[:-1]]
    out: dict[str, list[list[float]]] = {}
    for name, dtype in _dtypes(device):
        pts: list[list[float]] = []
        for m, n, k in shapes:
            a = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
            b = torch.randn(k, n, generator=gen, device=device, dtype=dtype)
            # Enough matmuls queued per timing that a fast device's launch and sync don't count.
            queued = int(grid.flops_per_timing / (2.0 * m * n * k)) if device.type == "cuda" else 1
            inner = max(1, min(64, queued))
            t = _best_time(lambda a=a, b=b, inner=inner: [a @ b for _ in range(inner)], device, grid.repeats,
                           grid.short_budget_s)
            pts.append([m, n, k, 2.0 * m * n * k * inner / t])
        out[name] = pts
    return out


def measure_attention(grid: Grid, device: torch.device, dtype: torch.dtype) -> list[list[float]]:
    """[(seq, head_dim, achieved FLOP/s of causal SDPA forward + backward)]: the work done, 12*s*d per
    query per head (PaLM, Appendix B) halved for the causal mask (Dao 2023, FlashAttention-2, Sec. 4.1)."""
    gen = torch.Generator(device=device).manual_seed(1)
    heads = grid.attention_heads
    pts: list[list[float]] = []
    for hd in grid.head_dims:
        for s in grid.attention_seqs:
            shape = (1, heads, s, hd)
            q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_()
                       for _ in range(3))

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            t = _best_time(step, device, grid.repeats, grid.short_budget_s)
            pts.append([s, hd, 6.0 * s * s * hd * heads / t])
    return pts


def measure_memory_bw(grid: Grid, device: torch.device) -> float:
    """Bytes/s of a large tensor copy (read + write counted, as STREAM's copy does; McCalpin 1995)."""
    src = torch.ones(grid.copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), device, grid.repeats)
    return 2.0 * grid.copy_bytes / t


def _collective_ops(rank: int, x: torch.Tensor, world: int) -> dict[str, Callable[[], Any]]:
    """One call of each collective on `x` (gloo and NCCL both implement all five in torch 2.x)."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    chunk = torch.empty(x.numel() // world, device=x.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.1x

    def send_recv() -> None:
        dist.send(x, 1) if rank == 0 else dist.recv(x, 0) if rank == 1 else None

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather(parts, x),
        "reduce_scatter": lambda: scatter(chunk, x),
        "send_recv": send_recv,
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(x), x),
    }


def _collective_rank(rank: int, world: int, grid: Grid) -> dict[str, Any]:
    import torch.distributed as dist

    backend = dist.get_backend()
    device = default_device() if backend == "nccl" else torch.device("cpu")
    out: dict[str, list[list[float]]] = {k: [] for k in COLLECTIVES}
    for nbytes in grid.message_bytes:
        # The same count on every rank (a count from each rank's own warm-up would differ, and hang).
        repeats = grid.repeats * (SHORT_REPEATS if nbytes <= SMALL_MESSAGE_BYTES else 1)
        x = torch.ones(nbytes // 4, device=device)
        ops = _collective_ops(rank, x, world)
        for name, op in ops.items():
            dist.barrier()
            out[name].append([float(nbytes), _best_time(op, device, repeats)])
    result: dict[str, Any] = {"backend": backend, "collectives": out}
    if grid.engine_points > 0 and backend == "gloo":
        from training.calibration.engine import engine_rank

        result["engine"] = engine_rank(rank, world, grid.repeats, grid.engine_points)
    return result


def measure_collectives(grid: Grid, world: int = 2, timeout_s: float = 120.0) -> dict[str, Any]:
    """{backend, collectives: kind -> [(bytes, seconds)]} between `world` ranks spawned on this node."""
    try:
        return run_local_ranks(world, _collective_rank, (grid,), threads=1, timeout_s=timeout_s,
                               init_timeout_s=60)[0]
    except LocalRankError as e:
        raise RuntimeError(f"calibration: {e}") from e


def link_rank(rank: int, master_addr: str, master_port: int, grid: Grid,
              timeout_s: float = 120.0) -> dict[str, Any]:
    """One of the two ranks of an inter-node link measurement (workers/calibration.py, measure_link): joins
    the group at the master, times the collectives as `measure_collectives` does, and leaves."""
    from training.parallel.dist import init_distributed, shutdown

    if default_device().type == "cpu":
        torch.set_num_threads(rank_threads())
    init_distributed(rank, 2, master_addr, master_port, timeout_s=timeout_s)
    try:
        return _collective_rank(rank, 2, dataclasses.replace(grid, engine_points=0))
    finally:
        shutdown()


OP_CHAIN = 64  # ops per timed call of the op-overhead chain
OP_WINDOW_S = 0.04  # seconds of calls per window; calibrate() takes one before and after each phase


class OpOverheadSampler:
    """Seconds of fixed cost per op forward + backward (dispatch, autograd, launch), on a tensor too
    small for its arithmetic to count: the mean over windows of `window_s` taken at several moments
    of the calibration (`sample()` between its phases).

    A shared host's speed changes over tenths of a second: the 2-core development VM alternated
    between ~11 and ~22 us per op in stretches of 0.1-0.6 s, and the median of one window of ~15
    calls read 11-26 us across calibrations of one quiet host, moving the demo's predicted compute
    by 57-88 ms. A training step lasts many such stretches and pays their mean; so does this.
    `clock` and `chain` are for tests.
    """

    def __init__(self, device: torch.device, window_s: float = OP_WINDOW_S, ops: int = OP_CHAIN,
                 clock: Callable[[], float] = time.perf_counter,
                 chain: Callable[[], Any] | None = None) -> None:
        self.device, self.window_s, self.ops, self._clock = device, window_s, ops, clock
        self.seconds, self.calls = 0.0, 0
        self.windows: list[float] = []  # each window's mean seconds per op (the profile's meta shows them)
        self._chain = chain or self._default_chain()
        self._chain()  # warm-up (allocations, autograd's first graph)

    def _default_chain(self) -> Callable[[], None]:
        x = torch.ones(8, device=self.device, requires_grad=True)

        def chain() -> None:
            y = x
            for _ in range(self.ops):
                y = y * 1.0001
            y.sum().backward()

        return chain

    def sample(self) -> None:
        """Time calls of the chain for `window_s` (at least one call)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start, n = self._clock(), 0
        while True:
            self._chain()
            if cuda:
                torch.cuda.synchronize(self.device)
            n += 1
            elapsed = self._clock() - start
            if elapsed >= self.window_s:
                break
        self.seconds += elapsed
        self.calls += n
        self.windows.append(elapsed / n / self.ops)

    def per_op(self) -> float:
        """Mean seconds per op over every window's calls (a slow stretch counts for the time it took)."""
        if self.calls == 0:
            self.sample()
        return self.seconds / self.calls / self.ops


def measure_optimizer(device: torch.device, repeats: int, budget_s: float = 0.0) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per parameter) of the engine's optimizer step (global-norm
    clip + AdamW + zero_grad) as it runs here: the fixed part from the slope between 16 and 64 tiny
    tensors, the per-element part from 4 tensors of 2^18 (on a GPU, the slope from 2^22 to 2^24).
    The ranks' AdamW is torch's fused kernel on CUDA and CPU (one pass per tensor); this measures it."""
    from torch import nn

    from training.parallel.optim import clip_grad_norm, use_fused_adamw

    def per_step(n: int, numel: int) -> float:
        part = nn.ParameterList([nn.Parameter(torch.randn(numel, device=device)) for _ in range(n)])
        params = list(part.parameters())
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True if use_fused_adamw(params) else None)
        grads = [torch.full_like(p, 1e-3) for p in params]

        def step() -> None:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            clip_grad_norm([part], 1.0, None)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _best_time(step, device, repeats, budget_s)

    per_tensor = max(0.0, (per_step(64, 64) - per_step(16, 64)) / 48)
    if device.type == "cuda":
        # A GPU steps 2^18 elements in microseconds, under its launch and clip costs: the per-element
        # part is the slope between 4 tensors of 2^22 and of 2^24 (64M parameters, 1 GiB of state).
        small, big = 1 << 22, 1 << 24
        return per_tensor, max(0.0, (per_step(4, big) - per_step(4, small)) / (4 * (big - small)))
    big = 1 << 18
    per_param = max(0.0, (per_step(4, big) - 4 * per_tensor) / (4 * big))
    return per_tensor, per_param


def rank_threads() -> int:
    """Threads one rank computes with on CPU: what the worker group gives it (OMP_NUM_THREADS, set to 1
    by workers/worker_group.py), so the profile measures what a rank achieves."""
    return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))


def calibrate(node_type: str, grid: Grid | None = None) -> dict[str, Any]:
    """The hardware profile document of this machine for `node_type` (version 0: the store numbers it)."""
    t0 = time.perf_counter()
    device = default_device()
    grid = grid or Grid.for_device(device)
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(rank_threads())
    wall0, cpu0 = time.perf_counter(), time.process_time()
    host_slowdown = 1.0
    phases: dict[str, float] = {}  # seconds per measurement, in the profile's meta

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        out = fn()
        phases[name] = round(time.perf_counter() - start, 3)
        return out

    ops = OpOverheadSampler(device)

    def sample_ops() -> None:
        start = time.perf_counter()
        ops.sample()
        phases["op_overhead"] = round(phases.get("op_overhead", 0.0) + time.perf_counter() - start, 3)

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        """One measurement, then a window of the op-overhead chain: its windows spread over the phases."""
        out = timed(name, fn)
        sample_ops()
        return out

    try:
        sample_ops()
        matmul = phase("matmul", lambda: measure_matmul(grid, device))
        compute_dtype = "bf16" if "bf16" in matmul else "fp32"
        dtype = torch.bfloat16 if compute_dtype == "bf16" else torch.float32
        doc: dict[str, Any] = {
            "node_type": node_type, "version": 0, "compute_dtype": compute_dtype, "matmul": matmul,
            "attention": phase("attention", lambda: measure_attention(grid, device, dtype)),
            "memory_bw": phase("memory_bw", lambda: measure_memory_bw(grid, device)),
            "collectives": {}, "ranks": 2, "backend": "",
        }  # fmt: skip
        optimizer = phase("optimizer", lambda: measure_optimizer(device, grid.repeats, grid.short_budget_s))
        doc["optimizer_tensor_s"], doc["optimizer_param_s"] = optimizer
        if device.type == "cpu":  # ranks share the host's cores only on CPU node types
            doc["oversubscription"] = timed("oversubscription", measure_oversubscription)
        doc["op_overhead_s"] = ops.per_op()
        threads = torch.get_num_threads()
        # The timings above are medians of short calls that mostly fit between other processes' time
        # slices; a training step lasts many slices and gets the CPU share the host leaves it: wall
        # seconds per CPU second of this (one-thread) process over the whole compute measurement.
        # Recorded, not planned with: a profile describes the node type, not the moment it was measured.
        busy = time.process_time() - cpu0
        if device.type == "cpu" and threads == 1 and busy > 0:
            host_slowdown = round(max(1.0, (time.perf_counter() - wall0) / busy), 3)
    finally:
        torch.set_num_threads(threads_before)
    # Two local ranks need two devices on a GPU node (NCCL); with one GPU the catalogue's links stay.
    if grid.collectives and (device.type == "cpu" or torch.cuda.device_count() >= 2):
        coll = timed("collectives", lambda: measure_collectives(grid))
        doc["collectives"], doc["backend"] = coll["collectives"], coll["backend"]
        # tp_linear, fsdp_unit, ddp_step, concurrency, step_overhead_s (engine.py)
        doc.update(coll.get("engine", {}))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    doc["meta"] = {"device": device_name, "threads": threads, "cores": os.cpu_count() or 1,
                   "torch": torch.__version__, "seconds": round(time.perf_counter() - t0, 3),
                   "host_slowdown": host_slowdown, "phases": phases,
                   "op_overhead_windows_us": [round(w * 1e6, 2) for w in ops.windows]}  # fmt: skip
    log.info("calibrated %s on %s in %.1f s", node_type, device_name, doc["meta"]["seconds"])
    return doc
