"""Silent-data-corruption primitives: fingerprints, replica votes, finiteness/spike checks, bit flips."""

from __future__ import annotations

import random
import struct

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_ranks
from training.integrity.detectors import (
    GradNormSpikeDetector,
    IntegrityError,
    LossSpikeDetector,
    check_finite,
    grad_norm,
)
from training.integrity.fingerprint import (
    find_divergent_replicas,
    param_fingerprint,
    vote,
    vote_fingerprints,
)
from training.integrity.injection import BitFlip, BitFlipInjector, flip_bit
from training.parallel.ddp import DDP

STEPS = 4
FLIP_STEP = 2


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def train_and_watch(
    rank: int,
    group: dist.ProcessGroup | None,
    flips: list[BitFlip],
    grad_detector: GradNormSpikeDetector | None = None,
) -> dict[str, object]:
    """Train a DDP replica; every step: inject, check loss and grad norm, fingerprint and vote."""
    torch.manual_seed(0)
    model = DDP(make_model(), bucket_size_mb=None, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    injector = BitFlipInjector(flips, rank)
    loss_detector = LossSpikeDetector(factor=10.0, warmup=2)
    events: list[dict[str, object]] = []
    for step in range(STEPS):
        injector.maybe_flip_params(step, model.named_parameters())
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        try:
            check_finite(loss, step)
            loss_detector.check(loss, step)
        except IntegrityError as e:
            events.append({"kind": e.kind, "step": e.step})
        injector.arm_grad_flips(step, model.named_parameters())  # overlapped DDP reduces during backward
        loss.backward()
        model.finish_gradient_synchronization()
        if grad_detector is not None:
            try:
                grad_detector.check(grad_norm(model.parameters()), step)
            except IntegrityError as e:
                events.append({"kind": e.kind, "step": e.step})
        opt.step()
        v = vote_fingerprints(param_fingerprint([model]), group)
        if not v.ok:
            events.append(
                {"kind": "divergent_replicas", "step": step, "ranks": v.divergent, "ambiguous": v.ambiguous}
            )
    return {"events": events, "applied": len(injector.applied)}


def _integrity_worker(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    pair = dist.new_group([0, 2])  # a DP group of two replicas (every rank must create it)
    out["clean"] = train_and_watch(rank, None, [], GradNormSpikeDetector(factor=10.0, warmup=2))
    # Three replicas: a mantissa bit of rank 1's parameter flips at FLIP_STEP; the majority names rank 1.
    flip = BitFlip(step=FLIP_STEP, rank=1, target="param", name="module.2.weight", index=5, bit=20)
    out["three"] = train_and_watch(rank, None, [flip])
    # Two replicas disagree: both are reported and the vote is ambiguous.
    if rank in (0, 2):
        flip2 = BitFlip(step=FLIP_STEP, rank=2, target="param", name="2.weight", index=3, bit=22)
        out["two"] = train_and_watch(rank, pair, [flip2])
        out["two_direct"] = find_divergent_replicas(param_fingerprint([make_model()]) + rank, pair)
    # An exponent flip in a local gradient before the all-reduce: every replica applies the same
    # corrupted average (fingerprints agree) but the global gradient norm spikes.
    gflip = BitFlip(step=FLIP_STEP, rank=0, target="grad", name="0.weight", index=7, bit=30)
    out["grad"] = train_and_watch(rank, None, [gflip], GradNormSpikeDetector(factor=10.0, warmup=2))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    return run_ranks(3, _integrity_worker)


def test_clean_run_raises_nothing(results: list[dict[str, object]]) -> None:
    for r in results:
        assert r["clean"]["events"] == []


def test_param_flip_detected_and_rank_named_by_majority(results: list[dict[str, object]]) -> None:
    assert results[1]["three"]["applied"] == 1
    for r in results:
        first = r["three"]["events"][0]
        assert first == {"kind": "divergent_replicas", "step": FLIP_STEP, "ranks": [1], "ambiguous": False}


def test_two_replicas_disagreeing_are_both_reported_as_ambiguous(results: list[dict[str, object]]) -> None:
    for rank in (0, 2):
        first = results[rank]["two"]["events"][0]
        assert first == {"kind": "divergent_replicas", "step": FLIP_STEP, "ranks": [0, 2], "ambiguous": True}
        assert results[rank]["two_direct"] == [0, 2]
    assert "two" not in results[1]


def test_grad_exponent_flip_caught_by_grad_norm_not_fingerprint(results: list[dict[str, object]]) -> None:
    for r in results:
        events = r["grad"]["events"]
        assert events and events[0] == {"kind": "grad_norm_spike", "step": FLIP_STEP}
        assert all(e["kind"] != "divergent_replicas" for e in events)


def test_fingerprint_changes_for_every_single_bit_flip() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    half = nn.Linear(8, 5).to(torch.bfloat16)
    fp16 = nn.Linear(3, 3).to(torch.float16)  # odd element counts in 16-bit dtypes
    parts = [model, half, fp16]
    params = [p for part in parts for p in part.parameters()]
    base = param_fingerprint(parts)
    rng = random.Random(1234)
    seen = set()
    for _ in range(300):
        p = rng.choice(params)
        index = rng.randrange(p.numel())
        bit = rng.randrange(p.element_size() * 8)
        flip_bit(p, index, bit)
        changed = param_fingerprint(parts)
        flip_bit(p, index, bit)
        assert changed != base, (p.shape, p.dtype, index, bit)
        seen.add(changed)
        assert param_fingerprint(parts) == base  # flipping back restores it exactly
    assert len(seen) > 250  # distinct flips give (almost always) distinct fingerprints


def _reference_fingerprint(tensors: list[torch.Tensor]) -> int:
    """param_fingerprint's formula in plain Python integers, from each tensor's raw bytes."""
    mask, row = (1 << 64) - 1, 1024  # int64 words per row (training.integrity.fingerprint._ROW)
    mix = 0x9E3779B97F4A7C15
    hi = lo = 0
    for t, x in enumerate(tensors):
        raw = x.detach().contiguous().view(torch.uint8).numpy().tobytes()
        e = x.element_size()
        # whole 8-byte words, unless the tensor does not start on an 8-byte boundary (then widened)
        n_main = len(raw) // 8 * 8 if x.storage_offset() * e % 8 == 0 else 0
        words = [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, n_main, 8)]
        words += [int.from_bytes(raw[i:i + e], "little", signed=True) for i in range(n_main, len(raw), e)]
        s = sum(words)
        p = 0
        n_rows = n_main // 8 // row
        for i, w in enumerate(words):
            r, c = (i // row, i % row) if i < n_rows * row else (n_rows, i - n_rows * row)
            p += (r + 1) * w + mix * (c + 1) * w
        hi += (2 * t + 1) * s
        lo += (2 * t + 1) * p
    return ((hi & mask) << 64) | (lo & mask)


def test_fingerprint_matches_its_formula_on_raw_bytes() -> None:
    torch.manual_seed(3)
    big = nn.Linear(160, 13)  # 2,080 float32 = 1,040 int64 words: a full row and a short last row
    odd = nn.Linear(3, 3).to(torch.float16)  # tails of 16-bit elements
    flat = torch.randn(1001)
    misaligned = nn.Module()
    misaligned.register_parameter("w", nn.Parameter(flat[1:]))  # storage offset of 4 bytes
    parts = [big, odd, misaligned]
    tensors = [p for part in parts for p in part.parameters()]
    assert param_fingerprint(parts) == _reference_fingerprint(tensors)


def test_fingerprint_is_position_sensitive_and_covers_all_parts() -> None:
    a = nn.Linear(4, 4)
    b = nn.Linear(4, 4)
    fp = param_fingerprint([a, b])
    assert fp != param_fingerprint([a]) and fp == param_fingerprint([a, b])
    with torch.no_grad():
        w = a.weight.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()  # swapped elements: same plain sum
    assert param_fingerprint([a, b]) != fp


def test_flip_bit_semantics() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    flip_bit(t, 0, 31)  # sign
    assert t.tolist() == [-1.0, 2.0, 3.0]
    flip_bit(t, 1, 23)  # lowest exponent bit: 2.0 (biased exponent 128) -> 4.0 (129)
    assert t[1].item() == 4.0
    bits = struct.unpack("<I", struct.pack("<f", 3.0))[0] ^ 1
    flip_bit(t, 2, 0)
    assert struct.unpack("<I", struct.pack("<f", t[2].item()))[0] == bits
    h = torch.tensor([1.0], dtype=torch.bfloat16)
    flip_bit(h, 0, 15)
    assert h.item() == -1.0
    f16 = torch.tensor([1.0], dtype=torch.float16)
    flip_bit(f16, 0, 10)  # lowest fp16 exponent bit: 1.0 -> 0.5
    assert f16.item() == 0.5
    with pytest.raises(ValueError, match="bit"):
        flip_bit(t, 0, 32)
    with pytest.raises(ValueError, match="index"):
        flip_bit(t, 3, 0)


def test_injector_applies_only_its_rank_step_and_target_once() -> None:
    model = DDPLikeWrapper(nn.Linear(2, 2))
    flips = [
        BitFlip(step=1, rank=0, target="param", name="lin.weight", index=0, bit=31),
        BitFlip(step=1, rank=1, target="param", name="lin.weight", index=1, bit=31),
        BitFlip(step=2, rank=0, target="grad", name="lin.bias", index=0, bit=31),
    ]
    inj = BitFlipInjector(flips, rank=0)
    before = model.module.lin.weight.detach().clone()
    assert inj.maybe_flip_params(0, model.named_parameters()) == []
    assert inj.maybe_flip_params(1, model.named_parameters()) == [flips[0]]  # "module." prefix ignored
    assert inj.maybe_flip_params(1, model.named_parameters()) == []  # applied once
    after = model.module.lin.weight.detach()
    assert after[0, 0] == -before[0, 0] and torch.equal(after.view(-1)[1:], before.view(-1)[1:])
    model.module.lin.bias.grad = torch.tensor([0.5, 0.25])
    assert inj.maybe_flip_grads(2, model.named_parameters()) == [flips[2]]
    assert model.module.lin.bias.grad.tolist() == [-0.5, 0.25]
    # Armed before backward: the incoming gradient is corrupted before accumulation (and DDP hooks).
    lin = nn.Linear(2, 1)
    arm = BitFlipInjector([BitFlip(step=3, rank=0, target="grad", name="bias", index=0, bit=31)], rank=0)
    assert arm.arm_grad_flips(2, lin.named_parameters()) == []
    assert len(arm.arm_grad_flips(3, lin.named_parameters())) == 1
    lin(torch.ones(1, 2)).sum().backward()
    assert lin.bias.grad.tolist() == [-1.0] and len(arm.applied) == 1
    lin(torch.ones(1, 2)).sum().backward()  # one-shot: the second backward is not corrupted
    assert lin.bias.grad.tolist() == [0.0]
    with pytest.raises(ValueError, match="target"):
        BitFlip(step=0, rank=0, target="weights", name="x", index=0, bit=0)  # type: ignore[arg-type]


class DDPLikeWrapper(nn.Module):
    def __init__(self, lin: nn.Module) -> None:
        super().__init__()
        self.module = nn.Module()
        self.module.lin = lin


def test_vote_majority_and_ambiguity() -> None:
    ranks = [4, 5, 6, 7]
    assert vote([1, 1, 1, 1], ranks).divergent == []
    v = vote([1, 1, 2, 1], ranks)
    assert (v.divergent, v.ambiguous, v.majority) == ([6], False, 1)
    v = vote([1, 1, 2, 3], ranks)
    assert (v.divergent, v.ambiguous) == ([6, 7], True)
    v = vote([1, 1, 2, 2], ranks)
    assert (v.divergent, v.ambiguous, v.majority) == (ranks, True, None)
    v = vote([1, 2], [0, 1])
    assert (v.divergent, v.ambiguous) == ([0, 1], True)


def test_check_finite_and_loss_spikes() -> None:
    check_finite(torch.tensor(2.5), 0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(IntegrityError) as e:
            check_finite(torch.tensor(bad), 7)
        assert e.value.kind == "nonfinite" and e.value.step == 7
    det = LossSpikeDetector(factor=10.0, warmup=3)
    for step, loss in enumerate([5.0, 4.0, 4.5, 4.2, 3.9]):
        det.check(torch.tensor(loss), step)
    det.check(30.0, 5)  # 7x the mean: not a spike
    with pytest.raises(IntegrityError) as e:
        det.check(torch.tensor(100.0), 6)
    assert e.value.kind == "loss_spike" and e.value.step == 6 and e.value.evidence["loss"] == 100.0
    det.check(4.0, 7)  # the spike did not raise the reference
    with pytest.raises(IntegrityError, match="nonfinite"):
        det.check(float("nan"), 8)
    early = LossSpikeDetector(factor=10.0, warmup=3)
    early.check(1.0, 0)
    early.check(1000.0, 1)  # warm-up: no reference yet


def test_grad_norm_spike_detector() -> None:
    det = GradNormSpikeDetector(factor=5.0, warmup=2)
    for step, norm in enumerate([1.0, 1.2, 0.9]):
        det.check(norm, step)
    with pytest.raises(IntegrityError) as e:
        det.check(1e30, 3)
    assert e.value.kind == "grad_norm_spike"
    with pytest.raises(ValueError, match="factor"):
        GradNormSpikeDetector(factor=1.0)
