"""ZeRO-1 (ShardedOptimizer) against a plain AdamW on every rank (lecture exercise 4).

    python -m bench.zero                # 2 and 4 ranks, ~21M-parameter GPT
    python -m bench.zero --worlds 2 --steps 5

Both configurations run the same model, data and DDP (25 MB buckets); only the optimizer differs.
Each (world, configuration) runs in fresh processes so process-level peaks are not shared.

Memory, measured three ways:
- tensor bytes (exact): parameters, gradients, and optimizer state (AdamW: exp_avg + exp_avg_sq
  + a step counter per parameter) as held by each rank. Predicted: state = 8 bytes/param unsharded,
  8/N bytes/param with ZeRO-1 (Rajbhandari et al. 2020, ZeRO, section 5.1); params and grads flat.
- process RSS (CPU): VmRSS after model init, right before and right after the first optimizer
  step (when AdamW allocates its state), and VmHWM (peak RSS over the process' life). torch's CPU
  allocator has no statistics and tracemalloc does not see its allocations, so RSS is the
  process-level view; it also counts the Python runtime, libraries and freed-but-cached pages.
- on GPU: torch.cuda.memory_allocated / max_memory_allocated at the same points.

Time: median optimizer step (ZeRO: the shard's AdamW plus the owners' broadcasts) and median full
step, slowest rank, with the overhead of ZeRO-1 relative to the plain optimizer.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from bench._common import Timer, bench_device, build_bench_model, machine, median, spawn, table
from training.parallel.ddp import DDP
from training.parallel.dist import all_gather_single
from training.parallel.zero import ShardedOptimizer

MB = 1024 * 1024
FIELDS = [
    "param_bytes",
    "grad_bytes",
    "state_bytes",
    "rss_init",
    "rss_before",
    "rss_after",
    "rss_peak",
    "dev_before",
    "dev_after",
    "dev_peak",
    "opt_step_s",
    "step_s",
]


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor_bytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))


def _worker(rank: int, world: int, cfg: dict[str, Any], zero: bool) -> dict[str, Any]:
    device = bench_device(rank)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model, loss_fn, vocab = build_bench_model(seed=0, device=device)
    ddp = DDP(model, bucket_size_mb=25.0)
    adamw = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if zero:
        opt: torch.optim.Optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **adamw)
        state_of = opt.inner.state  # type: ignore[attr-defined]
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw)
        state_of = opt.state
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + 1), generator=gen).to(device)
    m: dict[str, float] = {"rss_init": _proc_status_kb("VmRSS")}
    opt_times, step_times = [], []
    for i in range(1 + cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        with Timer(device) as step:
            loss_fn(ddp, tokens).backward()
            ddp.finish_gradient_synchronization()
            if i == 0:
                m["rss_before"] = _proc_status_kb("VmRSS")
                m["dev_before"] = torch.cuda.memory_allocated(device) if cuda else 0
                m["grad_bytes"] = _tensor_bytes(p.grad for p in model.parameters())
            with Timer(device) as ostep:
                opt.step()
            if i == 0:
                m["rss_after"] = _proc_status_kb("VmRSS")
                m["dev_after"] = torch.cuda.memory_allocated(device) if cuda else 0
        if i > 0:
            opt_times.append(ostep.elapsed)
            step_times.append(step.elapsed)
    m["param_bytes"] = _tensor_bytes(model.parameters())
    m["state_bytes"] = _tensor_bytes(t for s in state_of.values() for t in s.values())
    m["rss_peak"] = _proc_status_kb("VmHWM")
    m["dev_peak"] = torch.cuda.max_memory_allocated(device) if cuda else 0
    m["opt_step_s"] = median(opt_times)
    m["step_s"] = median(step_times)
    mine = torch.tensor([float(m[k]) for k in FIELDS], dtype=torch.float64, device=device)
    every = torch.empty(world * len(FIELDS), dtype=torch.float64, device=device)
    all_gather_single(every, mine)
    rows = every.view(world, len(FIELDS)).cpu().tolist()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "ranks": [dict(zip(FIELDS, r, strict=True)) for r in rows],
    }


def report(world: int, plain: dict[str, Any], zero: dict[str, Any]) -> list[str]:
    n = plain["params"]
    full_state = max(r["state_bytes"] for r in plain["ranks"])
    print(f"\n{world} ranks ({plain['device']}), {n / 1e6:.1f}M parameters, AdamW")
    rows = []
    for name, res in (("AdamW (replicated)", plain), ("ZeRO-1 ShardedOptimizer", zero)):
        for rank, r in enumerate(res["ranks"]):
            rows.append(
                [
                    name if rank == 0 else "",
                    rank,
                    r["param_bytes"] / MB,
                    r["grad_bytes"] / MB,
                    r["state_bytes"] / MB,
                    r["state_bytes"] / full_state,
                    r["rss_init"] / MB,
                    r["rss_before"] / MB,
                    r["rss_after"] / MB,
                    r["rss_peak"] / MB,
                ]
            )
    print(
        table(
            [
                "optimizer",
                "rank",
                "params MB",
                "grads MB",
                "opt state MB",
                "state / replicated",
                "RSS init MB",
                "RSS pre-step MB",
                "RSS post-step MB",
                "RSS peak MB",
            ],
            rows,
        )
    )
    if plain["device"].startswith("cuda"):
        dev_rows = [
            [name, r["dev_before"] / MB, r["dev_after"] / MB, r["dev_peak"] / MB]
            for name, res in (("AdamW", plain), ("ZeRO-1", zero))
            for r in res["ranks"][:1]
        ]
        print(table(["optimizer (rank 0)", "GPU alloc pre-step MB", "post-step MB", "peak MB"], dev_rows))
    t_plain = max(r["opt_step_s"] for r in plain["ranks"])
    t_zero = max(r["opt_step_s"] for r in zero["ranks"])
    s_plain = max(r["step_s"] for r in plain["ranks"])
    s_zero = max(r["step_s"] for r in zero["ranks"])
    times = [["AdamW (replicated)", t_plain * 1e3, s_plain * 1e3], ["ZeRO-1", t_zero * 1e3, s_zero * 1e3]]
    print(table(["optimizer", "opt.step ms", "full step ms"], times))
    worst = max(r["state_bytes"] for r in zero["ranks"]) / full_state
    ok = abs(worst - 1 / world) <= 0.05 / world
    return [
        f"{world} ranks: largest ZeRO-1 state share {worst:.4f} vs 1/N = {1 / world:.4f} "
        f"(target within 5%: {'met' if ok else 'NOT met'}); optimizer step {t_zero / t_plain:.2f}x, "
        f"full step {s_zero / s_plain:.2f}x the replicated optimizer's"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after 1 warm-up)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    cfg = {"steps": args.steps, "batch": args.batch, "seq": args.seq}
    print(f"bench/zero.py - {machine()}")
    verdicts = []
    for world in args.worlds:
        plain = spawn(world, _worker, (cfg, False))
        zero = spawn(world, _worker, (cfg, True))
        verdicts += report(world, plain, zero)
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
