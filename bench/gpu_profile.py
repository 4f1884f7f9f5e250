"""Where a training step's time goes on a GPU: one profiled step of a gpu_check layout.

    python -m bench.gpu_check --profile     # adds this section to the gpu_check report

For each profiled layout: the step's wall time, the GPU's busy time (the sum of its kernels), the
number of kernels launched, and the kernels and operators that take the most GPU time. A step whose
GPU is busy for much less than its wall time is bound by the host (dispatch, launches, syncs), not
by the arithmetic the planner counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepProfile:
    label: str
    wall_s: float = 0.0
    gpu_busy_s: float = 0.0
    kernels: int = 0
    top_kernels: list[tuple[str, int, float]] = field(default_factory=list)  # (name, calls, seconds)
    top_ops: list[tuple[str, int, float, float]] = field(default_factory=list)  # (+ host seconds)
    error: str | None = None


def _device_us(avg: Any, kind: str) -> float:
    """Seconds of GPU time of an entry of key_averages, `kind` "self_" or "" (torch renamed cuda_* to
    device_*)."""
    us = getattr(avg, f"{kind}device_time_total", None)
    return float(us if us is not None else getattr(avg, f"{kind}cuda_time_total", 0.0)) / 1e6


def _device_self(avg: Any) -> float:
    return _device_us(avg, "self_")


def _device_total(avg: Any) -> float:
    return _device_us(avg, "")


OPERATOR_PREFIXES = ("aten::", "c10d::", "autograd::", "torch::", "Optimizer.", "ProfilerStep")


def _is_operator(key: str) -> bool:
    return key.startswith(OPERATOR_PREFIXES)


def summarize(events: Any, label: str, wall_s: float, top: int = 15) -> StepProfile:
    """A StepProfile from `profiler.key_averages()`: kernels are the entries with GPU self time."""
    out = StepProfile(label, wall_s=wall_s)
    # torch 2.11 also gives some operators (aten::mm, Optimizer.step#...) the GPU self time of their
    # kernels: only entries that are not operators or annotations count, else the time counts twice.
    kernels = [(a.key, int(a.count), _device_self(a)) for a in events
               if _device_self(a) > 0 and not _is_operator(a.key)]
    out.gpu_busy_s = sum(t for *_, t in kernels)
    out.kernels = sum(c for _, c, _ in kernels)
    out.top_kernels = sorted(kernels, key=lambda k: -k[2])[:top]
    ops = [(a.key, int(a.count), _device_total(a), float(a.cpu_time_total) / 1e6) for a in events
           if a.key.startswith("aten::") and _device_total(a) > 0]
    out.top_ops = sorted(ops, key=lambda o: -o[2])[:top]
    return out


def profile_layout(r: Any, ctx: Any, model: Any = None, warmup: int = 2) -> StepProfile:
    """Train `warmup` steps of gpu_check's layout `r`, then profile one more (on CPU too: the tests)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_check import run_config
    from training.train import Trainer

    cfg = run_config(r, warmup + 1, model=model)
    cuda = ctx.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer = None
    try:
        trainer = Trainer(ctx, cfg)
        for step in range(1, warmup + 1):
            trainer.train_step(step)
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            trainer.train_step(warmup + 1)
            sync()
            wall = time.perf_counter() - t0
        return summarize(prof.key_averages(), r.label, wall)
    except Exception as e:  # noqa: BLE001 - reported in the section; the report is still written
        first = str(e).splitlines()[0][:160] if str(e) else ""
        return StepProfile(r.label, error=f"{type(e).__name__}: {first}")
    finally:
        if trainer is not None:
            trainer.close()
        if cuda:
            torch.cuda.empty_cache()


def profile_lines(profiles: list[StepProfile]) -> list[str]:
    """The report's section: a summary row per layout, then its top kernels and operators."""
    out = ["| layout | step wall s | GPU busy s | busy / wall | kernels |", "|---|---|---|---|---|"]
    for p in profiles:
        share = p.gpu_busy_s / p.wall_s if p.wall_s > 0 else 0.0
        out.append(f"| {p.label} | {p.wall_s:.3f} | {p.gpu_busy_s:.3f} | {share:.2f} | {p.kernels} |"
                   + (f" {p.error}" if p.error else ""))
    for p in profiles:
        if p.error:
            continue
        out += ["", f"### {p.label}: top kernels (GPU self time)", "", "| kernel | calls | ms |",
                "|---|---|---|"]
        out += [f"| {name[:90]} | {calls} | {1e3 * t:.1f} |" for name, calls, t in p.top_kernels]
        out += ["", f"### {p.label}: top operators (GPU time incl. children)", "",
                "| op | calls | GPU ms | host ms |", "|---|---|---|---|"]
        out += [f"| {name} | {calls} | {1e3 * t:.1f} | {1e3 * h:.1f} |" for name, calls, t, h in p.top_ops]
    return out
