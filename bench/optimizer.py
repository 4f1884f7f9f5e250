"""The ranks' AdamW step (training.parallel.optim.build_optimizer) against torch's default AdamW on the
same parameters, one process, one thread: the demo job's model (service.schemas.jobs.DEMO_SPEC) whole,
as one of its TP 2 x PP 4 ranks' shares (a quarter of the layers, half of each matrix), and that share
as DTensors (a one-rank gloo mesh: the dispatch a TP rank pays, without the collectives).

    python -m bench.optimizer [--steps 30] [--repeats 5]

On CPU torch's default is the single-tensor loop (its foreach kernels are CUDA-only): ~10 elementwise
ops per tensor, each dispatched from Python (through DTensor's dispatch for TP parameters); the ranks
use the fused kernel: one op for the whole list.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from bench._common import machine, median, table


def _params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def _time(step: Callable[[], None], steps: int, repeats: int) -> float:
    for _ in range(3):
        step()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append((time.perf_counter() - t) / steps)
    return median(runs)


def _as_dtensors(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The same values as DTensors sharded over a one-rank mesh (the process group made once)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29631")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    out = []
    for p in params:
        d = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
        d.grad = distribute_tensor(p.grad, mesh, [Shard(0)])
        out.append(d)
    return out


def _shapes(spec: dict, tp: int, pp: int) -> list[tuple[int, ...]]:
    from service.schemas.jobs import JobSpec
    from training.model.transformer import Transformer

    model_spec = JobSpec.model_validate(spec).model_spec()
    with torch.device("meta"):
        model = Transformer(model_spec)
    layers = model_spec.layers // pp
    shapes = []
    for name, p in model.named_parameters():
        if name.startswith("layers.") and int(name.split(".")[1]) >= layers:
            continue  # another stage's layers
        shape = tuple(p.shape)
        shapes.append((shape[0] // tp, *shape[1:]) if p.dim() == 2 and "layers." in name else shape)
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from service.schemas.jobs import DEMO_SPEC, JobSpec
    from training.config.layout import Layout
    from training.config.run import RunConfig
    from training.parallel.optim import build_optimizer

    rows = []
    cases = (("demo model, whole", 1, 1, False), ("one rank of TP 2 x PP 4", 2, 4, False),
             ("the same, DTensors", 2, 4, True))
    for label, tp, pp, dtensor in cases:
        shapes = _shapes(DEMO_SPEC, tp, pp)
        numel = sum(torch.Size(s).numel() for s in shapes)
        times = {}
        for impl in ("torch default", "lattice"):
            params = _as_dtensors(_params(shapes)) if dtensor else _params(shapes)
            module = torch.nn.ParameterList(params)
            if impl == "lattice":
                cfg = RunConfig(model=JobSpec.model_validate(DEMO_SPEC).model_spec(), layout=Layout(),
                                steps=1)
                opt = build_optimizer([module], Layout(), cfg, None)
            else:
                opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95))
            times[impl] = _time(opt.step, args.steps, args.repeats)
        rows.append([label, len(shapes), f"{numel / 1e6:.2f}M", f"{times['torch default'] * 1e3:.2f}",
                     f"{times['lattice'] * 1e3:.2f}", f"{times['torch default'] / times['lattice']:.2f}x"])
    print(f"# {machine()}; one thread; AdamW step, median of {args.repeats} x {args.steps} steps")
    print(table(["parameters", "tensors", "elements", "torch default ms", "lattice (fused) ms",
                 "default / lattice"], rows))


if __name__ == "__main__":
    main()
