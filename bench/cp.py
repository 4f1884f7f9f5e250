"""Ring attention (context parallel) at CP = 1, 2, 4 on one long sequence: time, memory, ring traffic.

    python -m bench.cp                        # S=4096, 8 query heads, 2 kv heads, head dim 32, causal
    python -m bench.cp --seq 2048 --cps 1,2 --steps 2

Per CP degree, every rank runs `ring_attention` forward + backward on its load-balanced shard
(training/parallel/context.py). Printed per rank (the slowest rank, all-reduce MAX):
- step: wall time of forward + backward; cpu: CPU seconds of the process in that step (on a
  machine with fewer cores than ranks the wall time includes waiting for a core, the CPU time not);
- saved: bytes of the tensors autograd keeps for backward, counted with
  torch.autograd.graph.saved_tensors_hooks (unique storages), against the prediction
  q + k + v + out + lse of S/cp tokens (the full-sequence figure divided by cp);
- ring fwd / bwd: bytes this rank sent with batch_isend_irecv, against the prediction
  fwd (cp-1) x kv_local, bwd (cp-1) x kv_local + cp x dkv_local (dK/dV accumulators in fp32 make
  one extra hop back to their owner), where kv_local = K and V of S/cp tokens; in total per rank
  fwd = (cp-1)/cp x (K+V bytes of the full sequence);
- planner: the cost model's own numbers (service.planner), next to the measurement:
  ring bytes per layer `cp_ring_bytes_per_layer` ((3cp-2) x kv_local in fp32), the per-rank
  activation ratio of `activation_bytes_per_layer(S/cp, ..., ring_attention=True)` to CP=1, and the
  predicted time of this attention on the planner's `cpu-virtual` device: 12 h S FLOPs per token
  (PaLM, no causal discount) + the ring's 2 h S recompute, over cp ranks, at its 10 GFLOP/s, plus the
  ring's exposed part (ring bytes at its 2 GB/s intra-node tier, overlapped with that compute).
The CP=1 row also shows torch's own SDPA (the CPU flash kernel) as the single-rank peer.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench._common import machine, median, spawn, table
from service.planner import get_gpu
from service.planner.costmodel import OVERLAP_SLOWDOWN
from service.planner.formulas import activation_bytes_per_layer, cp_ring_bytes_per_layer
from training.parallel.context import ring_attention, shard_sequence


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while the hook is active."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


class _SentBytes:
    """Counts the bytes this rank sends through dist.batch_isend_irecv (what the ring uses)."""

    def __init__(self) -> None:
        self.sent = 0
        self._orig = dist.batch_isend_irecv

    def __enter__(self) -> _SentBytes:
        def counting(ops: list[dist.P2POp]) -> list[dist.Work]:
            sends = [op.tensor for op in ops if op.op is dist.isend]
            self.sent += sum(t.numel() * t.element_size() for t in sends)
            return self._orig(ops)

        dist.batch_isend_irecv = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.batch_isend_irecv = self._orig  # type: ignore[assignment]


def _inputs(cfg: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    b, s, d = cfg["batch"], cfg["seq"], cfg["head_dim"]
    q = torch.randn(b, cfg["heads"], s, d, generator=g)
    k = torch.randn(b, cfg["kv_heads"], s, d, generator=g)
    v = torch.randn(b, cfg["kv_heads"], s, d, generator=g)
    return q, k, v


def _measure(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, steps: int) -> dict[str, float]:
    walls, cpus, saved, fwd_sent, bwd_sent = [], [], 0, 0, 0
    for step in range(steps + 1):  # the first step warms up
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        counter = _SavedBytes()
        if dist.is_initialized():
            dist.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        with _SentBytes() as fwd, torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            out = attn(qq, kk, vv)
        with _SentBytes() as bwd:
            out.backward(torch.ones_like(out))
        w1, c1 = time.perf_counter(), time.process_time()
        if step:
            walls.append(w1 - w0)
            cpus.append(c1 - c0)
        saved, fwd_sent, bwd_sent = counter.total, fwd.sent, bwd.sent
    return {"wall": median(walls), "cpu": median(cpus), "saved": saved, "fwd": fwd_sent, "bwd": bwd_sent}


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, float]:
    q, k, v = (shard_sequence(t, rank, world, dim=2) for t in _inputs(cfg))

    def attn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ring_attention(a, b, c, None, causal=True, kernel=cfg["kernel"])

    res = _measure(attn, q, k, v, cfg["steps"])
    keys = sorted(res)
    worst = torch.tensor([res[key] for key in keys], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(keys, worst.tolist(), strict=True))


def _predictions(cfg: dict[str, Any], cp: int) -> dict[str, float]:
    b, s, d, hq, hkv = cfg["batch"], cfg["seq"], cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
    s_loc, fp32 = s // cp, 4
    q_bytes, kv_local = b * hq * s_loc * d * fp32, 2 * b * hkv * s_loc * d * fp32
    lse = b * hq * s_loc * fp32
    h = hq * d
    # The planner (service/planner): ring bytes, activation scaling, and time on its cpu-virtual device.
    ring = cp_ring_bytes_per_layer(kv_local, cp, grad_bytes_ratio=1.0)  # fp32 activations
    act_ratio = activation_bytes_per_layer(s_loc, b, h, hq, ring_attention=True) / activation_bytes_per_layer(
        s, b, h, hq, ring_attention=True
    )
    gpu = get_gpu("cpu-virtual")
    flops = b * s_loc * (12.0 * h * s + (2.0 * h * s if cp > 1 else 0.0))
    compute = flops / (gpu.peak_flops * gpu.compute_efficiency)
    ring_t = ring / gpu.nvlink_bw + (2 * cp - 1) * gpu.intra_latency_s if cp > 1 else 0.0
    predicted_s = compute + max(0.0, ring_t - compute) + OVERLAP_SLOWDOWN * min(ring_t, compute)
    return {
        "saved": 2 * q_bytes + kv_local + lse,  # q, out, k + v, lse
        "fwd": (cp - 1) * kv_local,
        "bwd": (cp - 1) * kv_local + (cp * kv_local if cp > 1 else 0),  # dK/dV accumulators in fp32
        "planner": ring,
        "act_ratio": act_ratio,
        "time": predicted_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kernel", default="auto", choices=["auto", "fused", "math"], help="per-block attention")
    args = ap.parse_args()
    cfg = {
        "seq": args.seq,
        "batch": args.batch,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "steps": args.steps,
        "kernel": args.kernel,
    }
    print(f"# bench.cp  {machine()}")
    shape = f"B={args.batch} S={args.seq} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim}"
    print(
        f"# causal, fp32, {shape}, block kernel {args.kernel}, median of {args.steps} steps"
        " after 1 warm-up; MiB = 2^20 bytes"
    )

    rows: list[list[Any]] = []
    mib = 2.0**20
    q, k, v = _inputs(cfg)
    sdpa = _measure(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
        q,
        k,
        v,
        args.steps,
    )
    rows.append(
        ["torch SDPA (1 rank)", sdpa["wall"], sdpa["cpu"], "-", sdpa["saved"] / mib, "-", "-", "-", "-", "-"]
    )
    saved_1: float | None = None
    for cp in (int(c) for c in args.cps.split(",")):
        res = spawn(cp, _worker, (cfg,))
        pred = _predictions(cfg, cp)
        saved_1 = res["saved"] if cp == 1 else saved_1
        ratio = f"{res['saved'] / saved_1:.3f} / {pred['act_ratio']:.3f}" if saved_1 else "-"
        rows.append(
            [
                f"ring CP={cp}",
                res["wall"],
                res["cpu"],
                f"{pred['time']:.3f}",
                f"{res['saved'] / mib:.3f} / {pred['saved'] / mib:.3f}",
                ratio,
                f"{res['fwd'] / mib:.2f} / {pred['fwd'] / mib:.2f}",
                f"{res['bwd'] / mib:.2f} / {pred['bwd'] / mib:.2f}",
                f"{(res['fwd'] + res['bwd']) / mib:.2f} / {pred['planner'] / mib:.2f}",
                f"{res['cpu'] / pred['time']:.2f}",
            ]
        )
    print(
        table(
            [
                "attention fwd+bwd",
                "step s",
                "cpu s",
                "planner s",
                "saved MiB meas/pred",
                "act vs CP=1 meas/planner",
                "ring fwd MiB meas/pred",
                "ring bwd MiB meas/pred",
                "ring MiB meas/planner",
                "cpu s / planner s",
            ],
            rows,
        )
    )
    print(
        "# planner s: service.planner's prediction on its cpu-virtual device (10 GFLOP/s achieved, 2 GB/s"
        " intra-node), no causal discount; cpu s / planner s is the calibration error of that device."
    )


if __name__ == "__main__":
    main()
