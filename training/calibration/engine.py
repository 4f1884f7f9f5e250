"""What the engine's own parallel code costs on this host, beyond its arithmetic (2 local ranks, CPU).

A bare collective timed in a tight loop (measure.py) misses what a training step pays for one: the
DTensor dispatch around a tensor-parallel linear and its all-reduce, FSDP2's copy-in / copy-out and
hooks around each all-gather and reduce-scatter, the wake-up of the backend's threads after compute,
and two ranks computing at once on one host. So these are timed as the engine issues them:

- `tp_linear`: one linear sharded by `parallelize_module` (a ColwiseParallel + RowwiseParallel pair, as
  training/parallel/tensor.py shards attention and MLP), forward + backward, minus the same local
  matmuls without DTensor; per linear, over activation message sizes (each sharded linear issues one
  all-reduce of its (tokens, hidden) activation or input gradient).
- `fsdp_unit`: the engine's Transformer sharded by `apply_fsdp` as ZeRO-3 (training/parallel/fsdp.py: a
  unit per block plus the root), forward + backward, minus the same model unsharded; per unit, over
  the mean unit's parameter bytes (a 2-block model of hidden 128; above it, the extra bytes at the link's
  bandwidth).
- `ddp_step`: the same model under the engine's bucketed DDP (training/parallel/ddp.py, ZeRO-0), forward
  + backward + the final wait, minus the model alone; over gradient bytes.
- `concurrency`: time of a matmul when every rank runs one at once over the time when one rank runs
  it alone (shared cores, caches and memory bandwidth, and whatever else the host runs).
- `step_overhead_s`: seconds per step of the engine's training loop (training/train.py) beyond its
  forward + backward, DP reduction and optimizer phases: the data, integrity and loss-summary phases
  (the summary's all-gather over the world and its read-back) and the loop's own checks, from the
  ranks' phase timers over a few steps of the real Trainer on a 2-block model (per step, not per
  micro-batch: each of those phases runs once a step).

Each cost is the median over repeats of (mean time of a loop with the parallel code - mean time of
the same loop without), the two timed in turn (a step adds up means, not medians).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

TP_TOKENS = (256, 1024)  # (tokens, hidden 128) activations: 128 KiB and 512 KiB fp32 messages
TP_HIDDEN = 128
MODEL_HIDDEN = 128  # a 2-block model of the engine: ~0.6 MiB units (its FSDP2 cost is mostly fixed)


def _mean(fn: Callable[[], Any], iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _extra(with_it: Callable[[], Any], without: Callable[[], Any], iters: int, repeats: int) -> float:
    """Median over `repeats` of (mean seconds of `with_it` - mean seconds of `without`), the two timed in
    turn each repeat so that a change in the host's load falls on both (one warm-up call each)."""
    import torch.distributed as dist

    with_it(), without()
    diffs = []
    for _ in range(max(1, repeats)):
        dist.barrier()
        a = _mean(with_it, iters)
        dist.barrier()
        diffs.append(a - _mean(without, iters))
    return max(0.0, statistics.median(diffs))


def _fwd_bwd(net: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        net(x).float().sum().backward()
        for p in net.parameters():
            p.grad = None
        x.grad = None

    return step


def measure_tp_linear(world: int, repeats: int, tokens: Sequence[int] = TP_TOKENS,
                      hidden: int = TP_HIDDEN) -> list[list[float]]:
    """[(message bytes, seconds per sharded linear forward + backward beyond its local matmuls)]."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    out: list[list[float]] = []
    for t in tokens:
        h, f = hidden, 4 * hidden
        sharded = nn.Sequential(nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False))
        parallelize_module(sharded, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        local = nn.Sequential(nn.Linear(h, f // world, bias=False), nn.Linear(f // world, h, bias=False))
        # The input needs its gradient: ColwiseParallel's backward all-reduces it (as between blocks).
        x = torch.randn(t, h, requires_grad=True)
        extra = _extra(_fwd_bwd(sharded, x), _fwd_bwd(local, x), 6, repeats)
        out.append([float(t * h * x.element_size()), extra / 2])  # two linears
    return out


def _demo_like(h: int, copies: int) -> tuple[list[nn.Module], torch.Tensor, int, int]:
    """`copies` identical 2-block Transformers of hidden `h` (the engine's own model), a token batch,
    the parameter bytes and the layer count."""
    from training.config.spec import ModelSpec
    from training.model.transformer import Transformer

    spec = ModelSpec(layers=2, hidden=h, heads=4, kv_heads=2, vocab=256, seq_len=64, name="calibration")
    models: list[nn.Module] = []
    for _ in range(copies):
        torch.manual_seed(0)
        model = Transformer(spec)
        model.init_weights(0)
        models.append(model)
    nbytes = sum(p.numel() * p.element_size() for p in models[0].parameters())
    tokens = torch.randint(0, spec.vocab, (4, spec.seq_len), generator=torch.Generator().manual_seed(0))
    return models, tokens, nbytes, spec.layers


def measure_fsdp_unit(world: int, repeats: int, hidden: Sequence[int] = (MODEL_HIDDEN,)) -> list[list[float]]:
    """[(mean unit parameter bytes, seconds per ZeRO-3 unit forward + backward beyond its arithmetic)]."""
    from torch.distributed.device_mesh import init_device_mesh

    from training.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (world,))
    out: list[list[float]] = []
    for h in hidden:
        (plain, sharded), tokens, nbytes, layers = _demo_like(h, 2)
        apply_fsdp(sharded, mesh, reshard_after_forward=True, device_type="cpu")  # type: ignore[arg-type]
        units = layers + 1  # a unit per block and the root (embedding, norm, head)
        extra = _extra(_fwd_bwd(sharded, tokens), _fwd_bwd(plain, tokens), 3, repeats)
        out.append([nbytes / units, extra / units])
    return out


def measure_ddp_step(repeats: int, hidden: Sequence[int] = (MODEL_HIDDEN,)) -> list[list[float]]:
    """[(gradient bytes, seconds the engine's bucketed DDP adds to a step's forward + backward: its
    gradient hooks and all-reduces (gloo, on the cores the ranks compute on), and the final wait)]."""
    from training.parallel.ddp import DDP

    out: list[list[float]] = []
    for h in hidden:
        (plain, replica), tokens, nbytes, _ = _demo_like(h, 2)
        ddp = DDP(replica, bucket_size_mb=25.0)  # training/parallel/ddp.py's default buckets

        def step(ddp: DDP = ddp, tokens: torch.Tensor = tokens) -> None:
            ddp(tokens).float().sum().backward()
            ddp.finish_gradient_synchronization()
            for p in ddp.parameters():
                p.grad = None

        out.append([float(nbytes), _extra(step, _fwd_bwd(plain, tokens), 3, repeats)])
    return out


def measure_concurrency(rank: int, repeats: int, size: int = 256) -> float:
    """Seconds of a (2s, 4s, s) matmul with every rank running it at once over rank 0 running it alone
    (>= 1; the same on every rank: rank 0's ratio is broadcast)."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(2 * size, size, generator=gen), torch.randn(size, 4 * size, generator=gen)
    iters, ratios = 10, []
    _mean(lambda: a @ b, 1)
    for _ in range(max(1, repeats)):  # in turn, so that a change in the host's load falls on both
        dist.barrier()
        alone = _mean(lambda: a @ b, iters) if rank == 0 else 0.0  # the others wait in the barrier
        dist.barrier()
        together = _mean(lambda: a @ b, iters)
        ratios.append(together / alone if rank == 0 else 0.0)
    ratio = torch.tensor([max(1.0, statistics.median(ratios)) if rank == 0 else 0.0])
    dist.broadcast(ratio, 0)
    return float(ratio.item())


OVERHEAD_STEPS = (3, 9)  # (warm-up, timed) steps of the real training loop


def measure_step_overhead(rank: int, world: int, steps: tuple[int, int] = OVERHEAD_STEPS) -> float:
    """Median seconds per step of the training loop outside its compute, dp_sync and optimizer phases
    (what the cost model times separately), on a DP `world` run of a 2-block model of hidden 128,
    micro-batch 4; the fingerprint comparison is off (not every layout has it). Rank 0's figure is
    broadcast: it is the rank whose step time a run reports."""
    import torch.distributed as dist

    from training.config.layout import Layout
    from training.config.run import IntegrityConfig, RunConfig
    from training.config.spec import ModelSpec
    from training.hooks import StepInfo, TrainHooks
    from training.parallel.dist import DistContext
    from training.train import train

    warmup, timed = steps
    spec = ModelSpec(layers=2, hidden=MODEL_HIDDEN, heads=4, kv_heads=2, vocab=256, seq_len=64,
                     name="calibration")
    cfg = RunConfig(model=spec, layout=Layout(dp=world, micro_batch_size=4, num_microbatches=1),
                    steps=warmup + timed, integrity=IntegrityConfig(fingerprint_every=0))
    rest: list[float] = []

    class Collect(TrainHooks):
        def on_step(self, info: StepInfo) -> None:
            modelled = sum(info.phases.get(k, 0.0) for k in ("compute", "dp_sync", "optimizer"))
            if info.step > warmup:
                rest.append(max(0.0, info.step_time_s - modelled))

    train(DistContext(rank, world, torch.device("cpu"), "gloo"), cfg, Collect(), resume=False)
    value = torch.tensor([statistics.median(rest) if rest else 0.0], dtype=torch.float64)
    dist.broadcast(value, 0)
    return float(value.item())


def engine_rank(rank: int, world: int, repeats: int, points: int = 2) -> dict[str, Any]:
    """The measurements on one of `world` gloo ranks, TP at its first `points` sizes (at least 5 repeats:
    a median of 5 differences survives two bursts of the host's other load)."""
    repeats = max(5, repeats)
    return {
        "concurrency": measure_concurrency(rank, repeats),
        "tp_linear": measure_tp_linear(world, repeats, TP_TOKENS[:points]),
        "fsdp_unit": measure_fsdp_unit(world, repeats),
        "ddp_step": measure_ddp_step(repeats),
        "step_overhead_s": measure_step_overhead(rank, world),
    }
