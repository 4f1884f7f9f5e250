"""Ring attention (training/parallel/context.py) against full attention on the gathered sequence.

One spawn of 4 gloo ranks runs every distributed case: CP=4 over the world, and CP=2 over two
subgroups {0,1} and {2,3} that hold different head counts (3 and 2 query heads: 5 heads split
unevenly by a TP-like head split, one CP ring per head shard).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_ranks
from training.parallel.context import (
    ContextParallelError,
    _block_pairs,
    _segments,
    cp_attention,
    cp_chunk_ids,
    cp_positions,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

TOL = 1e-5
Results = list[dict[str, dict[str, float]]]

# name -> (cp, batch, q heads, kv heads, seq, head dim, causal, load_balance, block kernel);
# cp=2 cases run once per subgroup. "auto" is torch's fused CPU flash kernel here; "math" the einsum path.
CASES: dict[str, tuple[int, int, int, int, int, int, bool, bool, str]] = {
    "cp4_causal": (4, 2, 4, 4, 32, 8, True, True, "auto"),
    "cp4_noncausal": (4, 2, 4, 4, 32, 8, False, True, "auto"),
    "cp4_causal_gqa": (4, 2, 6, 2, 32, 8, True, True, "auto"),
    "cp4_causal_gqa_math": (4, 2, 6, 2, 32, 8, True, True, "math"),
    "cp4_causal_contiguous": (4, 1, 2, 1, 24, 8, True, False, "auto"),
    "cp2_causal": (2, 2, 0, 0, 40, 8, True, True, "auto"),  # heads set per subgroup below
    "cp2_noncausal": (2, 2, 0, 0, 40, 8, False, True, "auto"),
    "cp2_causal_math": (2, 2, 0, 0, 40, 8, True, True, "math"),
}
SUBGROUP_HEADS = {0: (3, 1), 1: (2, 2)}  # subgroup index -> (q heads, kv heads)


def _case_tensors(seed: int, b: int, hq: int, hkv: int, s: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    w = torch.randn(b, hq, s, d, generator=g)  # upstream gradient: loss = sum(out * w)
    return q, k, v, w


def _run_case(
    seed: int,
    group: Any,
    cp_rank: int,
    cp: int,
    b: int,
    hq: int,
    hkv: int,
    s: int,
    d: int,
    causal: bool,
    lb: bool,
    kernel: str,
) -> dict[str, float]:
    q, k, v, w = _case_tensors(seed, b, hq, hkv, s, d)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, enable_gqa=hq != hkv)
    (ref * w).sum().backward()

    local = [shard_sequence(t, cp_rank, cp, dim=2, load_balance=lb).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, causal=causal, load_balance=lb, kernel=kernel)
    (out * shard_sequence(w, cp_rank, cp, dim=2, load_balance=lb)).sum().backward()

    def err(mine: torch.Tensor, full: torch.Tensor) -> float:
        return (unshard_sequence(mine.detach(), group, dim=2, load_balance=lb) - full).abs().max().item()

    return {
        "out": err(out, ref.detach()),
        "dq": err(local[0].grad, ref_in[0].grad),
        "dk": err(local[1].grad, ref_in[1].grad),
        "dv": err(local[2].grad, ref_in[2].grad),
        "grad_scale": ref_in[1].grad.abs().max().item(),  # guards against vacuous all-zero grads
    }


def _cp_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    results: dict[str, dict[str, float]] = {}
    for seed, (name, (cp, b, hq, hkv, s, d, causal, lb, kernel)) in enumerate(CASES.items()):
        if cp == 4:
            results[name] = _run_case(seed, None, rank, 4, b, hq, hkv, s, d, causal, lb, kernel)
        else:
            sub = rank // 2
            hq, hkv = SUBGROUP_HEADS[sub]
            results[f"{name}_group{sub}_heads{hq}"] = _run_case(
                100 * sub + seed, halves[sub], rank % 2, 2, b, hq, hkv, s, d, causal, lb, kernel
            )
    return results


@pytest.fixture(scope="module")
def cp_results() -> Results:
    return run_ranks(4, _cp_worker)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_matches_full_attention(cp_results: Results, name: str) -> None:
    checked = 0
    for rank, per_rank in enumerate(cp_results):
        for case, errs in per_rank.items():
            if case != name and not case.startswith(name + "_group"):
                continue
            checked += 1
            assert errs["grad_scale"] > 1e-3, f"{case}: reference gradient is ~0, the check would be vacuous"
            for what in ("out", "dq", "dk", "dv"):
                assert errs[what] < TOL, f"rank {rank} {case}: max |{what} - reference| = {errs[what]:.3g}"
    assert checked == 4, f"{name}: expected 4 rank results, got {checked}"


def test_uneven_heads_per_subgroup_were_exercised(cp_results: Results) -> None:
    names = {case for per_rank in cp_results for case in per_rank}
    assert {"cp2_causal_group0_heads3", "cp2_causal_group1_heads2"} <= names


# ---- single-process checks (no spawn) --------------------------------------------------------------------


def test_shard_positions_and_chunks() -> None:
    seq = torch.arange(16)
    shards = [shard_sequence(seq, r, 4, dim=0) for r in range(4)]
    assert shards[0].tolist() == [0, 1, 14, 15]
    assert shards[3].tolist() == [6, 7, 8, 9]
    for r in range(4):
        assert torch.equal(cp_positions(16, r, 4), shards[r])
        assert cp_chunk_ids(r, 4) == (r, 7 - r)
    assert sorted(torch.cat(shards).tolist()) == list(range(16))
    assert cp_positions(12, 1, 3, load_balance=False).tolist() == [4, 5, 6, 7]


def test_unshard_without_process_group_is_identity() -> None:
    x = torch.randn(2, 8)
    assert torch.equal(unshard_sequence(x, None, dim=1), x)


def test_bad_lengths_and_shapes_are_rejected() -> None:
    with pytest.raises(ContextParallelError, match=r"divisible by 2 x cp \(8\)"):
        shard_sequence(torch.zeros(1, 12), 0, 4, dim=1)
    with pytest.raises(ContextParallelError, match="kv heads"):
        kv = torch.zeros(1, 2, 4, 2)
        ring_attention(torch.zeros(1, 3, 4, 2), kv, kv, None, causal=True)
    with pytest.raises(ContextParallelError, match="cp_rank"):
        cp_chunk_ids(4, 4)
    with pytest.raises(ContextParallelError, match="kernel must be one of"):
        ring_attention(kv, kv, kv, None, causal=False, kernel="flash")


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_load_balanced_causal_work_is_even(cp: int) -> None:
    """Every rank computes the same number of score entries over the whole ring."""
    s_local = 2 * 5

    def work(rank: int, lb: bool) -> int:
        total = 0
        for step in range(cp):
            src = (rank - step) % cp
            q_segs, kv_segs = _segments(rank, cp, s_local, lb), _segments(src, cp, s_local, lb)
            for rows, cols, diag in _block_pairs(q_segs, kv_segs, True, s_local):
                total += (rows.stop - rows.start) * (cols.stop - cols.start) // (2 if diag else 1)
        return total

    balanced = [work(rank, True) for rank in range(cp)]
    assert len(set(balanced)) == 1, balanced
    contiguous = [work(rank, False) for rank in range(cp)]
    assert len(set(contiguous)) == cp, contiguous  # the imbalance that the two-chunk layout removes


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_single_rank_ring_matches_sdpa_and_gradcheck(causal: bool, kernel: str) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    out = ring_attention(q, k, v, None, causal=causal, kernel=kernel)
    ref = cp_attention(q, k, v, None, causal=causal)  # no group: plain SDPA
    torch.testing.assert_close(out, ref)

    def attn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ring_attention(a, b, c, None, causal=causal, kernel=kernel)

    assert torch.autograd.gradcheck(attn, (q, k, v))


@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_bf16_inputs_accumulate_in_fp32(kernel: str) -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*low, None, causal=True, kernel=kernel)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in low)
    assert (out.float() - ref).abs().max().item() < 3e-2
