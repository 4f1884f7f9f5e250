"""Context parallel: ring attention over the `cp` process group, with causal load balancing.

Why our own ring and not `torch.distributed.tensor.experimental.context_parallel`: in torch 2.13
that API only dispatches the CUDA SDPA kernels (flash / efficient / cuDNN); on CPU the SDPA op is
`_scaled_dot_product_flash_attention_for_cpu`, which it cannot shard. See docs/context_parallel.md
for the exact errors.

The sequence of every (B, H, S, D) activation is split into `2 * cp` chunks; CP rank r holds chunks
r and 2*cp-1-r (`shard_sequence`), so under a causal mask every rank does the same work (Llama 3
section 3.3.2 / Megatron-LM CP). Inside attention, each rank keeps its queries while the K/V blocks
travel around the ring (Liu et al. 2023, "Ring Attention"); partial results are merged with the
online-softmax log-sum-exp recurrence (Milakov & Gimelshein 2018; Dao 2023, FlashAttention-2, alg. 1).
The backward recomputes each block's probabilities from the saved log-sum-exp (FlashAttention-2,
alg. 2) and sends the dK/dV accumulators around the ring behind the K/V blocks, so the saved
activations per rank are q, k, v, out and lse of the local chunk only: 1/cp of the full sequence.

The model uses:
    ids_local = shard_sequence(ids, cp_rank, cp_size, dim=1)        # data loader, also for labels
    pos = cp_positions(seq_len, cp_rank, cp_size)                    # RoPE angles at global positions
    out = cp_attention(q, k, v, cp_group, causal=True)               # (B, Hq, S_local, D)
and averages gradients over dp x cp (CP ranks see different tokens of the same sequences).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

_KV_TAG = 0
_DKV_TAG = 1


class ContextParallelError(ValueError):
    """Inputs that ring attention cannot shard; the message names the argument and what is allowed."""


# ---- sequence sharding ---------------------------------------------------------------------------


def cp_chunk_ids(cp_rank: int, cp_size: int, *, load_balance: bool = True) -> tuple[int, ...]:
    """Indices of the sequence chunks CP rank `cp_rank` holds, in local order.

    Load-balanced: 2*cp chunks, rank r holds (r, 2*cp-1-r). Otherwise: cp chunks, rank r holds (r,).
    """
    if not 0 <= cp_rank < cp_size:
        raise ContextParallelError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if load_balance else (cp_rank,)


def _num_chunks(cp_size: int, load_balance: bool) -> int:
    return 2 * cp_size if load_balance else cp_size


def _check_seq_len(seq_len: int, cp_size: int, load_balance: bool) -> int:
    n = _num_chunks(cp_size, load_balance)
    if seq_len % n != 0:
        what = "2 x cp" if load_balance else "cp"
        raise ContextParallelError(f"sequence length ({seq_len}) must be divisible by {what} ({n})")
    return seq_len // n


def shard_sequence(
    x: torch.Tensor, cp_rank: int, cp_size: int, dim: int, *, load_balance: bool = True
) -> torch.Tensor:
    """This rank's slice of the full sequence along `dim` (chunks r and 2*cp-1-r, concatenated)."""
    chunk = _check_seq_len(x.size(dim), cp_size, load_balance)
    ids = cp_chunk_ids(cp_rank, cp_size, load_balance=load_balance)
    parts = [x.narrow(dim, c * chunk, chunk) for c in ids]
    return torch.cat(parts, dim=dim).contiguous()


def unshard_sequence(
    x: torch.Tensor, cp_group: ProcessGroup | None, dim: int, *, load_balance: bool = True
) -> torch.Tensor:
    """Inverse of `shard_sequence`: all-gather the local slices and put the chunks back in order.

    Not differentiable (evaluation, tests, checkpoint export).
    """
    cp_size = _cp_size(cp_group)
    if cp_size == 1:
        return x
    pieces = [torch.empty_like(x) for _ in range(cp_size)]
    dist.all_gather(pieces, x.contiguous(), group=cp_group)
    per_rank = len(cp_chunk_ids(0, cp_size, load_balance=load_balance))
    chunk = x.size(dim) // per_rank
    ordered: list[torch.Tensor | None] = [None] * _num_chunks(cp_size, load_balance)
    for r, piece in enumerate(pieces):
        for j, c in enumerate(cp_chunk_ids(r, cp_size, load_balance=load_balance)):
            ordered[c] = piece.narrow(dim, j * chunk, chunk)
    return torch.cat(ordered, dim=dim)  # type: ignore[arg-type]


def cp_positions(
    seq_len: int,
    cp_rank: int,
    cp_size: int,
    *,
    load_balance: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token positions (S_local,) of the chunks this rank holds, for RoPE and masks."""
    chunk = _check_seq_len(seq_len, cp_size, load_balance)
    ids = cp_chunk_ids(cp_rank, cp_size, load_balance=load_balance)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in ids])


# ---- block math (grouped-query: q viewed as (B, Hkv, G, S, D), k/v as (B, Hkv, S, D)) ----------------


@dataclass(frozen=True)
class _Segment:
    chunk: int  # global chunk index (position order)
    start: int  # offset inside the local tensor
    length: int


def _segments(cp_rank: int, cp_size: int, s_local: int, load_balance: bool) -> list[_Segment]:
    ids = cp_chunk_ids(cp_rank, cp_size, load_balance=load_balance)
    length = s_local // len(ids)
    return [_Segment(c, j * length, length) for j, c in enumerate(ids)]


def _block_pairs(
    q_segs: list[_Segment], kv_segs: list[_Segment], causal: bool, s_local: int
) -> list[tuple[slice, slice, bool]]:
    """(q rows, kv cols, diagonal?) for every block with at least one visible key.

    Causal: a query chunk sees an earlier key chunk fully, its own chunk through a lower-triangular
    mask, and a later chunk not at all (skipped: the load-balanced layout makes the skips even).
    """
    if not causal:
        return [(slice(0, s_local), slice(0, s_local), False)]
    pairs = []
    for qs in q_segs:
        for ks in kv_segs:
            if qs.chunk >= ks.chunk:
                pairs.append(
                    (
                        slice(qs.start, qs.start + qs.length),
                        slice(ks.start, ks.start + ks.length),
                        qs.chunk == ks.chunk,
                    )
                )
    return pairs


KERNELS = ("auto", "fused", "math")
_FUSED_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def _use_fused(kernel: str, q: torch.Tensor) -> bool:
    """The fused CPU flash-attention kernel (tiled, returns log-sum-exp, native GQA) when it applies."""
    available = q.device.type == "cpu" and hasattr(torch.ops.aten, _FUSED_CPU)
    if kernel == "fused" and not available:
        raise ContextParallelError(f"kernel='fused' needs CPU tensors and aten.{_FUSED_CPU}, got {q.device}")
    return kernel == "fused" or (kernel == "auto" and available)


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, s, d = q.shape
    return q.view(b, hkv, hq // hkv, s, d)  # query head h uses kv head h // G (enable_gqa order)


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q5, k) * scale  # (B, Hkv, G, Sq, Sk)
    if diagonal:
        n = s.size(-1)
        upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q rows over one K/V block: (out (B, Hq, Sq, D), lse (B, Hq, Sq), lse >= fp32)."""
    if fused:
        out, lse = getattr(torch.ops.aten, _FUSED_CPU)(q, k, v, 0.0, diagonal, scale=scale)
        return out, lse
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _scores(_grouped(q, k.size(1)).to(acc), k.to(acc), scale, diagonal)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq)
    out = torch.einsum("bhgqk,bhkd->bhgqd", torch.exp(s - lse.unsqueeze(-1)), v.to(acc))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    diagonal: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), given the *final* out and lse of the q rows: with those,
    P = exp(S - lse) is the block's slice of the full softmax (FlashAttention-2, alg. 2)."""
    if fused:
        dq, dk, dv = getattr(torch.ops.aten, _FUSED_CPU + "_backward")(
            do, q, k, v, out, lse, 0.0, diagonal, scale=scale
        )
        return dq, dk, dv
    acc = torch.promote_types(q.dtype, torch.float32)
    hkv = k.size(1)
    q5, do5, k, v = _grouped(q, hkv).to(acc), _grouped(do, hkv).to(acc), k.to(acc), v.to(acc)
    delta = (do5 * _grouped(out, hkv).to(acc)).sum(-1)  # D_i = rowsum(dO * O), alg. 2 line 4
    p = torch.exp(_scores(q5, k, scale, diagonal) - _grouped(lse.unsqueeze(-1), hkv))
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, do5)
    ds = p * (torch.einsum("bhgqd,bhkd->bhgqk", do5, v) - delta.unsqueeze(-1))
    dq = torch.einsum("bhgqk,bhkd->bhgqd", ds, k) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", ds, q5) * scale
    return dq.flatten(1, 2), dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """In place: combine two softmax-normalised partials by their log-sum-exp (FlashAttention-2, alg. 1)."""
    new_lse = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


# ---- ring communication ------------------------------------------------------------------------------


class _Ring:
    """Point-to-point neighbours of this rank in the CP group (send to next, receive from previous)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def shift(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
        """Start sending `send` to the next rank and receiving the previous rank's tensor."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _cp_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# ---- the autograd function ------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: ProcessGroup | None,
        causal: bool,
        scale: float,
        load_balance: bool,
        fused: bool,
    ) -> torch.Tensor:
        s_local = q.size(2)
        ring = _Ring(group) if _cp_size(group) > 1 else None
        size, rank = (ring.size, ring.rank) if ring else (1, 0)
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, Hq, S_local, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # (B, Hq, S_local)
        q_segs = _segments(rank, size, s_local, load_balance)

        kv = torch.stack([k, v])  # (2, B, Hkv, S_local, D): one message per hop
        for step in range(size):
            works: list[dist.Work] = []
            if ring is not None and step < size - 1:
                next_kv, works = ring.shift(kv, _KV_TAG)  # overlaps with this step's compute
            src = (rank - step) % size
            kv_segs = _segments(src, size, s_local, load_balance)
            for rows, cols, diag in _block_pairs(q_segs, kv_segs, causal, s_local):
                blk_out, blk_lse = _block_forward(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, diag, fused
                )
                _merge(out[:, :, rows], lse[:, :, rows], blk_out.to(acc), blk_lse.to(acc))
            if works:
                _wait(works)
                kv = next_kv

        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, causal, scale, load_balance, fused)
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, load_balance, fused = ctx.settings
        s_local = q.size(2)
        ring = _Ring(group) if _cp_size(group) > 1 else None
        size, rank = (ring.size, ring.rank) if ring else (1, 0)
        acc = torch.promote_types(q.dtype, torch.float32)
        do = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        q_segs = _segments(rank, size, s_local, load_balance)

        kv = torch.stack([k, v])
        dkv_works: list[dist.Work] = []
        dkv_in: torch.Tensor | None = None
        for step in range(size):
            kv_works: list[dist.Work] = []
            if ring is not None and step < size - 1:
                next_kv, kv_works = ring.shift(kv, _KV_TAG)
            src = (rank - step) % size
            dkv = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # this rank's share for block `src`
            kv_segs = _segments(src, size, s_local, load_balance)
            for rows, cols, diag in _block_pairs(q_segs, kv_segs, causal, s_local):
                bdq, bdk, bdv = _block_backward(
                    do[:, :, rows],
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    scale,
                    diag,
                    fused,
                )
                dq[:, :, rows] += bdq
                dkv[0][:, :, cols] += bdk
                dkv[1][:, :, cols] += bdv
            if ring is None:
                dkv_in = dkv
                break
            if dkv_works:  # the accumulator for block `src` from the ranks it visited before us
                _wait(dkv_works)
                assert dkv_in is not None
                dkv += dkv_in
            # Pass the accumulator on; after the last step it lands on the block's owner.
            dkv_in, dkv_works = ring.shift(dkv, _DKV_TAG)
            if kv_works:
                _wait(kv_works)
                kv = next_kv
        _wait(dkv_works)
        assert dkv_in is not None
        return (dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None, None)


# ---- public entry points -----------------------------------------------------------------------------------


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: ProcessGroup | None,
    *,
    causal: bool,
    scale: float | None = None,
    load_balance: bool = True,
    kernel: str = "auto",
) -> torch.Tensor:
    """Exact attention over the full sequence, computed from this rank's sequence shard.

    q: (B, Hq, S_local, D); k, v: (B, Hkv, S_local, D) with Hq % Hkv == 0 (GQA computed grouped,
    K/V are never repeated, so the ring carries Hkv heads). Inputs are this rank's shard as made by
    `shard_sequence(..., load_balance=load_balance)`; every rank of `cp_group` passes the same shapes.
    Returns (B, Hq, S_local, D) in q's dtype; fp16/bf16 inputs are accumulated in fp32.
    `cp_group=None` means the default group. No dropout, no attention mask beyond `causal`.
    kernel: the per-block attention. "fused" = torch's CPU flash-attention kernel
    (aten._scaled_dot_product_flash_attention_for_cpu and its backward, which take the final
    out/lse, so a block's gradient needs no extra pass); "math" = einsum + explicit softmax (any
    device; the reference); "auto" = fused where available, else math.
    """
    if kernel not in KERNELS:
        raise ContextParallelError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ContextParallelError(
            f"q, k, v must be (B, H, S_local, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ContextParallelError(
            f"k and v must be (B, Hkv, S_local, D) matching q {tuple(q.shape)}, "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.size(1) % k.size(1) != 0:
        raise ContextParallelError(f"kv heads ({k.size(1)}) must divide query heads ({q.size(1)})")
    size = _cp_size(cp_group)
    if causal and q.size(2) % len(cp_chunk_ids(0, size, load_balance=load_balance)) != 0:
        raise ContextParallelError(f"local sequence length ({q.size(2)}) must be even when load_balance=True")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    out = _RingAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cp_group,
        causal,
        scale,
        load_balance,
        _use_fused(kernel, q),
    )
    return out  # type: ignore[no-any-return]


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: ProcessGroup | None,
    *,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """What the model's attention calls: plain SDPA without CP, the ring with CP (same shapes)."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
        )
    return ring_attention(q, k, v, cp_group, causal=causal, scale=scale)
