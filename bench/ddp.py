"""Data-parallel variants against torch DDP, measured in the same run (lecture exercise 3).

    python -m bench.ddp                 # 2 and 4 ranks, ~21M-parameter GPT, default steps
    python -m bench.ddp --worlds 2 --rounds 3 --steps 4

Variants: no communication (compute only: the floor), naive (one blocking all-reduce per parameter
after backward), flat (one all-reduce of every gradient), per-parameter overlapped (bucket None),
bucketed at each --buckets size, and torch DDP (bucket_cap_mb=25, forward_sync_buffers=False). Each
round builds every variant afresh and times --steps steps after one warm-up step; rounds interleave
the variants so that a change in machine load hits them alike. A step's time is the slowest
rank's (all-reduce MAX).

Columns: median step time; time in `finish_gradient_synchronization` (the communication the
backward pass did not hide; torch DDP waits inside backward, so it has none here); comm overhead
= 1 - (no-comm step / step), the share of the step that data parallelism added; ratio to torch DDP
(< 1 is faster); speed-up over naive.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench._common import Timer, bench_device, build_bench_model, machine, median, spawn, table
from training.parallel.ddp import DDP, FlatDDP, NaiveDDP

Maker = Callable[[nn.Module], Any] | str | None  # a wrapper factory, "torch" (torch DDP) or None (no comm)


def _variants(buckets: list[float]) -> list[tuple[str, Maker]]:
    out: list[tuple[str, Maker]] = [
        ("no-comm", None),
        ("naive", NaiveDDP),
        ("flat", FlatDDP),
        ("per-param overlapped", lambda m: DDP(m, bucket_size_mb=None)),
    ]
    out += [(f"bucketed {b:g} MB", lambda m, b=b: DDP(m, bucket_size_mb=b)) for b in buckets]
    out.append(("torch DDP", "torch"))
    return out


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    device = bench_device(rank)
    model, loss_fn, vocab = build_bench_model(seed=0, device=device)
    torch_model, _, _ = build_bench_model(seed=0, device=device)
    # forward_sync_buffers=False: like ours, sync buffers once at construction, not before every forward.
    torch_ddp = nn.parallel.DistributedDataParallel(
        torch_model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=25,
        forward_sync_buffers=False,
    )
    n_params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + 1), generator=gen).to(device)
    variants = _variants(cfg["buckets"])
    step_times: dict[str, list[float]] = {name: [] for name, _ in variants}
    finish_times: dict[str, list[float]] = {name: [] for name, _ in variants}

    for _ in range(cfg["rounds"]):
        for name, make in variants:
            if make == "torch":
                wrapped: Any = torch_ddp
                params = list(torch_model.parameters())
            else:
                wrapped = make(model) if callable(make) else model
                params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=1e-4)
            for i in range(1 + cfg["steps"]):
                opt.zero_grad(set_to_none=False)
                dist.barrier()
                with Timer(device) as step:
                    loss_fn(wrapped, tokens).backward()
                    with Timer(device) as fin:
                        if hasattr(wrapped, "finish_gradient_synchronization"):
                            wrapped.finish_gradient_synchronization()
                    opt.step()
                if i > 0:  # the first step of each round warms up
                    step_times[name].append(step.elapsed)
                    finish_times[name].append(fin.elapsed)
            if isinstance(wrapped, DDP):
                wrapped.remove_hooks()

    names = [name for name, _ in variants]
    t = torch.tensor([list(pair) for n in names for pair in zip(step_times[n], finish_times[n], strict=True)])
    t = t.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    t = t.cpu()
    per = len(step_times[names[0]])
    result = {"params": n_params, "backend": dist.get_backend(), "device": str(device), "rows": {}}
    for k, n in enumerate(names):
        block = t[k * per : (k + 1) * per]
        result["rows"][n] = {"step": median(block[:, 0].tolist()), "finish": median(block[:, 1].tolist())}
    return result


def report(world: int, res: dict[str, Any]) -> list[str]:
    rows = res["rows"]
    base = rows["no-comm"]["step"]
    ref = rows["torch DDP"]["step"]
    naive = rows["naive"]["step"]
    table_rows = []
    for name, r in rows.items():
        table_rows.append(
            [
                name,
                r["step"] * 1e3,
                r["finish"] * 1e3,
                max(0.0, 1 - base / r["step"]),
                r["step"] / ref,
                naive / r["step"],
            ]
        )
    print(f"\n{world} ranks ({res['backend']}, {res['device']}), {res['params'] / 1e6:.1f}M parameters")
    print(table(["variant", "step ms", "finish ms", "comm overhead", "vs torch DDP", "x naive"], table_rows))
    bucketed = {n: r["step"] for n, r in rows.items() if n.startswith("bucketed")}
    best = min(bucketed, key=bucketed.__getitem__)
    within = bucketed[best] / ref
    speedup = naive / bucketed[best]
    verdicts = [
        f"{world} ranks: best bucketed = {best}: {within:.3f}x torch DDP's step time "
        f"(target <= 1.05: {'met' if within <= 1.05 else 'NOT met'}); "
        f"{speedup:.2f}x faster than naive (target >= 2: {'met' if speedup >= 2 else 'NOT met'})"
    ]
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--buckets", type=float, nargs="+", default=[1, 5, 10, 25, 50, 100])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all variants")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round (+1 warm-up)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    cfg = {
        "buckets": args.buckets,
        "rounds": args.rounds,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
    }
    print(f"bench/ddp.py - {machine()}")
    print(f"batch {args.batch} x {args.seq} tokens per rank, {args.rounds} rounds x {args.steps} timed steps")
    verdicts = []
    for world in args.worlds:
        verdicts += report(world, spawn(world, _worker, (cfg,)))
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
