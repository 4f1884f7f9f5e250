"""What the engine's own parallel code costs on this host, beyond its arithmetic (2 local ranks, CPU).

A bare collective timed in a tight loop (measure.py) misses what a training step pays for one: the
DTensor dispatch around a tensor-parallel linear and its all-reduce, FSDP2's copy-in / copy-out and
hooks around each all-gather and reduce-scatter, the wake-up of the backend's threads after compute,
and two ranks computing at once on one host. So these are timed as the engine issues them:

- `tp_linear`: the engine's Transformer (a 2-block model of hidden 128) sharded by
  `apply_tensor_parallel` (training/parallel/tensor.py: q, k, v, MLP up / gate column-wise, o and MLP
  down row-wise, the embedding and head over the vocabulary), forward + backward, minus a model of the
  shapes one TP rank computes (every sharded weight cut to its local shard, plain modules); per sharded
  linear (each issues one all-reduce of its (tokens, hidden) activation or input gradient; the
  embedding and head count as one each), over activation message sizes. Timed inside the model, not as
  a bare ColwiseParallel + RowwiseParallel pair: between collectives the ranks compute attention, norms
  and the other linears, and the pair loop read 20-30% below what a step pays per linear (measured:
  2.2-2.8 ms against 3.0-3.5 ms a linear in the demo's TP 2 steps).
- `fsdp_unit`: the engine's Transformer sharded by `apply_fsdp` as ZeRO-3 (training/parallel/fsdp.py: a
  unit per block plus the root), forward + backward, minus the same model unsharded; per unit, over
  the mean unit's parameter bytes (a 2-block model of hidden 128; above it, the extra bytes at the link's
  bandwidth).
- `fsdp_optimizer_tensor_s`: seconds per parameter tensor that FSDP2's DTensor parameters add to the
  optimizer step (AdamW's foreach ops dispatched through DTensor), over the same shards as plain tensors.
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
# Steps of that model per timing (~10 ms each here): with 3, the DDP step's cost (a difference of two
# timings) read 3.8-8.9 ms across six calibrations of one quiet host.
MODEL_ITERS = 8


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

    return step


def _local_shapes(model: nn.Module, tp: int) -> nn.Module:
    """`model` with every weight `apply_tensor_parallel` shards cut to one rank's local shard (plain
    modules): the arithmetic a TP rank does, without the collectives and DTensor around it."""
    for block in model.layers.values():  # type: ignore[union-attr]
        a, f = block.attention, block.feed_forward
        for owner, name, col in ((a, "wq", True), (a, "wk", True), (a, "wv", True), (a, "wo", False),
                                 (f, "w1", True), (f, "w3", True), (f, "w2", False)):
            lin = getattr(owner, name)
            if lin is not None:
                shape = (lin.in_features, lin.out_features // tp) if col else (lin.in_features // tp,
                                                                               lin.out_features)
                setattr(owner, name, nn.Linear(*shape, bias=False))
    emb, head = model.tok_embeddings, model.output
    model.tok_embeddings = nn.Embedding(emb.num_embeddings // tp, emb.embedding_dim)  # type: ignore[union-attr]
    model.output = nn.Linear(head.in_features, head.out_features // tp, bias=False)  # type: ignore[union-attr]
    return model


def _sharded_linears(model: nn.Module) -> int:
    """Collectives a TP forward + backward issues, one per sharded linear plus the embedding and head."""
    blocks = model.layers.values()  # type: ignore[union-attr]
    return sum(6 + (b.feed_forward.w3 is not None) for b in blocks) + 2


def measure_tp_linear(world: int, repeats: int, tokens: Sequence[int] = TP_TOKENS,
                      hidden: int = TP_HIDDEN) -> list[list[float]]:
    """[(message bytes, seconds per sharded linear forward + backward beyond its local arithmetic)],
    timed inside the engine's TP-sharded Transformer (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    from training.config.spec import ModelSpec
    from training.model.transformer import Transformer
    from training.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world,))
    spec = ModelSpec(layers=2, hidden=hidden, heads=8, kv_heads=2, vocab=512, seq_len=64, name="calibration")
    out: list[list[float]] = []
    for t in tokens:
        torch.manual_seed(0)
        sharded = Transformer(spec)
        sharded.init_weights(0)
        apply_tensor_parallel(sharded, mesh, sequence_parallel=False)
        local = _local_shapes(Transformer(spec), world)
        batch = torch.randint(0, spec.vocab // world, (max(1, t // spec.seq_len), spec.seq_len),
                              generator=torch.Generator().manual_seed(0))
        iters = max(2, 6 * TP_TOKENS[0] // t)  # ~the same seconds per timing at every size
        extra = _extra(_fwd_bwd(sharded, batch), _fwd_bwd(local, batch), iters, repeats)
        out.append([float(t * hidden * 4), extra / _sharded_linears(local)])  # fp32 activations
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
        extra = _extra(_fwd_bwd(sharded, tokens), _fwd_bwd(plain, tokens), MODEL_ITERS, repeats)
        out.append([nbytes / units, extra / units])
    return out


def measure_fsdp_optimizer(world: int, repeats: int) -> float:
    """Seconds per parameter tensor an AdamW step over FSDP2 (DTensor) shards takes beyond the same step
    over the same local shards as plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    from training.parallel.fsdp import apply_fsdp
    from training.parallel.optim import use_fused_adamw

    (sharded,), tokens, _, _ = _demo_like(MODEL_HIDDEN, 1)
    apply_fsdp(sharded, init_device_mesh("cpu", (world,)), reshard_after_forward=True, device_type="cpu")
    sharded(tokens).float().sum().backward()
    dparams = list(sharded.parameters())
    plain = [nn.Parameter(p.to_local().detach().clone()) for p in dparams]  # type: ignore[attr-defined]
    for p, d in zip(plain, dparams, strict=True):
        p.grad = d.grad.to_local().clone()  # type: ignore[union-attr]
    steps = [torch.optim.AdamW(ps, lr=1e-3, fused=use_fused_adamw(ps) or None).step  # as the ranks'
             for ps in (dparams, plain)]
    return _extra(steps[0], steps[1], MODEL_ITERS // 2, repeats) / len(dparams)


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

        out.append([float(nbytes), _extra(step, _fwd_bwd(plain, tokens), MODEL_ITERS, repeats)])
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
        "fsdp_optimizer_tensor_s": measure_fsdp_optimizer(world, repeats),
        "ddp_step": measure_ddp_step(repeats),
        "step_overhead_s": measure_step_overhead(rank, world),
    }
