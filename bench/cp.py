"""Ring attention (context parallel) at CP = 1, 2, 4 on one long sequence: time, memory, ring traffic.

    python -m bench.cp                        # S=4096, 8 query heads, 2 kv heads, head dim 32, causal
    python -m bench.cp --seq 2048 --cps 1,2 --steps 2

Per CP degree, every rank runs `ring_attention` forward + backward on its load-balanced shard
(training/context_parallel.py). Printed per rank (the slowest rank, all-reduce MAX):
- step: wall time of forward + backward; cpu: CPU seconds of the process in that step (on a
  machine with fewer cores than ranks the wall time includes waiting for a core, the CPU time not);
- saved: bytes of the tensors autograd keeps for backward, counted with
  torch.autograd.graph.saved_tensors_hooks (unique storages), against the prediction
  q + k + v + out + lse of S/cp tokens (the full-sequence figure divided by cp);
- ring fwd / bwd: bytes this rank sent with batch_isend_irecv, against the prediction
  fwd (cp-1) x kv_local, bwd (cp-1) x kv_local + cp x dkv_local (dK/dV accumulators in fp32 make
  one extra hop back to their owner), where kv_local = K and V of S/cp tokens; in total per rank
  fwd = (cp-1)/cp x (K+V bytes of the full sequence);
- planner: the cost model's ring bytes per layer, 3 (cp-1) x kv_local
  (service/planner/costmodel.py, forward K/V + backward K/V + their gradients).
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
from training.context_parallel import ring_attention, shard_sequence


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
    b, s_loc, d, hq, hkv = cfg["batch"], cfg["seq"] // cp, cfg["head_dim"], cfg["heads"], cfg["kv_heads"]
    fp32 = 4
    q_bytes, kv_local = b * hq * s_loc * d * fp32, 2 * b * hkv * s_loc * d * fp32
    lse = b * hq * s_loc * fp32
    return {
        "saved": 2 * q_bytes + kv_local + lse,  # q, out, k + v, lse
        "fwd": (cp - 1) * kv_local,
        "bwd": (cp - 1) * kv_local + (cp * kv_local if cp > 1 else 0),  # dK/dV accumulators in fp32
        "planner": 3 * (cp - 1) * kv_local,  # service/planner/costmodel.py (per layer, fwd + bwd)
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
    rows.append(["torch SDPA (1 rank)", sdpa["wall"], sdpa["cpu"], sdpa["saved"] / mib, "-", "-", "-", "-"])
    for cp in (int(c) for c in args.cps.split(",")):
        res = spawn(cp, _worker, (cfg,))
        pred = _predictions(cfg, cp)
        rows.append(
            [
                f"ring CP={cp}",
                res["wall"],
                res["cpu"],
                res["saved"] / mib,
                pred["saved"] / mib,
                f"{res['fwd'] / mib:.2f} / {pred['fwd'] / mib:.2f}",
                f"{res['bwd'] / mib:.2f} / {pred['bwd'] / mib:.2f}",
                f"{(res['fwd'] + res['bwd']) / mib:.2f} / {pred['planner'] / mib:.2f}",
            ]
        )
    print(
        table(
            [
                "attention fwd+bwd",
                "step s",
                "cpu s",
                "saved MiB",
                "predicted MiB",
                "ring fwd MiB meas/pred",
                "ring bwd MiB meas/pred",
                "ring total MiB meas/planner",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
