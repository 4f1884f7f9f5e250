"""Measured pipeline bubble per schedule against the formula (p - 1) / (v * m).

For each schedule torch runs (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble,
ZBVZeroBubble, DualPipeV) this runs the project's model split over `p` pipeline ranks
(training.parallel.pipeline, real gloo point-to-point) for `m` micro-batches and times the step. The
bubble-free time is the same model's forward + backward over the same global batch in one
process, divided by p (a perfect split of the work). The measured overhead is then

    bubble_measured = t_step / (t_single / p) - 1

which holds the bubble plus the point-to-point sends and any stage imbalance, so it is an
upper bound of the schedule's bubble. The theory column is the lecture's (p - 1) / m, divided
by v for the interleaved schedules (Narayanan et al. 2021, section 2.2.2); zero-bubble
schedules aim at 0 (Qi et al. 2023).

    python -m bench.pipeline [--p 2] [--m 2,4,8] [--steps 4]

On a CPU box keep p <= cores: ranks that wait give their core to the others, which hides the
bubble. The table says so when p exceeds the cores.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench._common import machine, median, spawn, table
from training.config.layout import Layout
from training.config.run import OptimConfig, RunConfig
from training.config.spec import ModelSpec
from training.model.transformer import build_model, cross_entropy_loss
from training.parallel.mesh import ParallelDims
from training.parallel.pipeline import build_pipeline

SCHEDULES: list[tuple[str, int]] = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("interleaved_zero_bubble", 2),
    ("zbv_zero_bubble", 2),
    ("dualpipev", 2),
]


def bench_model(layers: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=256, heads=8, vocab=1024, seq_len=128, name="bench-pp")


def _batch(spec: ModelSpec, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (global_batch, spec.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def single_process_time(spec: ModelSpec, m: int, steps: int) -> float:
    """Median fwd + bwd time of the whole model over m micro-batches of one sequence each."""
    model = build_model(spec, seed=0)
    inputs, targets = _batch(spec, m)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        for i in range(m):
            loss = cross_entropy_loss(model(inputs[i : i + 1]), targets[i : i + 1]) / m
            loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return median(times[1:])


def _rank(rank: int, world: int, spec_d: dict, layout_d: dict, steps: int) -> float:
    spec, layout = ModelSpec.from_dict(spec_d), Layout.from_dict(layout_d)
    cfg = RunConfig(model=spec, layout=layout, steps=steps, optim=OptimConfig())
    dims = ParallelDims.build(layout, "cpu")
    pipe = build_pipeline(spec, cfg, dims, torch.device("cpu"))
    inputs, targets = _batch(spec, layout.global_batch)
    times = []
    for _ in range(steps + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        pipe.step(inputs, targets)
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
        for module in pipe.modules:
            module.zero_grad(set_to_none=True)
    return median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=2, help="pipeline ranks")
    ap.add_argument("--m", default="2,4,8", help="micro-batch counts")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    p, ms = args.p, [int(x) for x in args.m.split(",")]
    wanted = set(args.schedules.split(","))
    spec = bench_model(layers=4 * p)
    print(f"# bench/pipeline.py  {machine()}  p={p}  model {spec.layers} x {spec.hidden}, seq {spec.seq_len}")
    if p > (os.cpu_count() or 1):
        print(f"# note: p={p} > {os.cpu_count()} cores: waiting ranks lend their core, the bubble is hidden")
    rows = []
    for m in ms:
        t_single = single_process_time(spec, m, args.steps)
        for schedule, v in SCHEDULES:
            if schedule not in wanted:
                continue
            if m < p * v and schedule != "gpipe":
                rows.append([schedule, v, m, "-", "-", "-", f"needs m >= {p * v}"])
                continue
            layout = Layout(pp=p, dp=1, micro_batch_size=1, num_microbatches=m, schedule=schedule,
                            virtual_stages=v)
            try:
                t_step = spawn(p, _rank, (spec.to_dict(), layout.to_dict(), args.steps))
            except Exception as e:  # noqa: BLE001 - report the schedule that failed and go on
                rows.append([schedule, v, m, "-", "-", "-", f"failed: {str(e).splitlines()[-1][:60]}"])
                continue
            measured = t_step / (t_single / p) - 1
            theory = (p - 1) / (v * m)
            rows.append([schedule, v, m, f"{t_step * 1e3:.0f}", f"{measured:.3f}", f"{theory:.3f}",
                         f"{measured / theory:.2f}x theory" if theory else ""])
        rows.append(["(single process)", 1, m, f"{t_single * 1e3:.0f}", "", "", "bubble-free x p"])
    print(table(["schedule", "v", "m", "step ms", "bubble measured", "(p-1)/(v m)", "note"], rows))


if __name__ == "__main__":
    main()
