"""Hand-written DDP variants on real gloo ranks against a single-process run on the same global batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.distributed import run_ranks
from training.parallel.ddp import DDP, FlatDDP, NaiveDDP

GLOBAL_BATCH = 8
STEPS = 3
TOL = 1e-5


class TiedNet(nn.Module):
    """Embedding tied to the output head, a frozen layer, a buffer: what DDP must get right."""

    def __init__(self, vocab: int = 16, d: int = 8, reentrant: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(d))
        self.reentrant = reentrant

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h)) + 0.1 * self.frozen(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)  # (B, T, d)
        if self.reentrant:
            # fc.weight is also used outside the checkpoint: its gradient is accumulated twice per
            # backward (once by the re-entrant inner backward), which DDP must still reduce correctly.
            h = checkpoint(self.block, h, use_reentrant=True) + h @ self.fc.weight
        else:
            h = self.block(h)
        return self.head(h * self.scale)  # (B, T, vocab)


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def tied_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randint(0, 16, (GLOBAL_BATCH, 5), generator=g)
    return x, torch.randint(0, 16, (GLOBAL_BATCH, 5), generator=g)


def tied_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def local_slice(batch: tuple[torch.Tensor, ...], rank: int, world: int) -> tuple[torch.Tensor, ...]:
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def reference_params(make: Callable[[], nn.Module], batch_fn, loss_fn) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch_fn(step)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_ddp(
    wrap: Callable[[nn.Module], nn.Module],
    make: Callable[[], nn.Module],
    batch_fn,
    loss_fn,
    rank: int,
    world: int,
    micro_batches: int = 1,
    seed: int = 0,
) -> nn.Module:
    torch.manual_seed(seed)
    model = wrap(make())
    opt = torch.optim.SGD(model.module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        local = local_slice(batch_fn(step), rank, world)
        n = local[0].shape[0] // micro_batches
        for m in range(micro_batches):
            mb = tuple(t[m * n : (m + 1) * n] for t in local)
            if m < micro_batches - 1:
                with model.no_sync():
                    (loss_fn(model, mb) / micro_batches).backward()
            else:
                (loss_fn(model, mb) / micro_batches).backward()
        model.finish_gradient_synchronization()
        opt.step()
    return model.module


def max_diff(model: nn.Module, ref: dict[str, torch.Tensor]) -> float:
    return max((p.detach() - ref[n]).abs().max().item() for n, p in model.named_parameters())


VARIANTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "naive": lambda m: NaiveDDP(m),
    "flat": lambda m: FlatDDP(m),
    "per_param": lambda m: DDP(m, bucket_size_mb=None),
    "bucket_tiny": lambda m: DDP(m, bucket_size_mb=1e-4),
    "bucket_small": lambda m: DDP(m, bucket_size_mb=1e-3),
    "bucket_25mb": lambda m: DDP(m, bucket_size_mb=25.0),
}


def _ddp_worker(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    mlp_ref = reference_params(make_mlp, mlp_batch, mlp_loss)
    tied_ref = reference_params(TiedNet, tied_batch, tied_loss)
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in make_mlp().named_parameters()}
    out["ref_moved"] = max(
        (mlp_ref[n] - initial[n]).abs().max().item() for n in initial
    )  # the comparison is not vacuous
    for name, wrap in VARIANTS.items():
        out[f"mlp/{name}"] = max_diff(train_ddp(wrap, make_mlp, mlp_batch, mlp_loss, rank, world), mlp_ref)
        model = train_ddp(wrap, TiedNet, tied_batch, tied_loss, rank, world)
        out[f"tied/{name}"] = max_diff(model, tied_ref)
        out[f"tied_still_tied/{name}"] = model.head.weight is model.emb.weight
        out[f"frozen_untouched/{name}"] = model.frozen.weight.grad is None and bool(
            torch.equal(model.frozen.weight, tied_ref["frozen.weight"])
        )
        acc = train_ddp(wrap, make_mlp, mlp_batch, mlp_loss, rank, world, micro_batches=2)
        out[f"accum/{name}"] = max_diff(acc, mlp_ref)
    out["buckets_small"] = DDP(make_mlp(), bucket_size_mb=1e-3).num_buckets
    out["buckets_25mb"] = DDP(make_mlp(), bucket_size_mb=25.0).num_buckets
    out["buckets_none"] = DDP(make_mlp(), bucket_size_mb=None).num_buckets

    reent_ref = reference_params(lambda: TiedNet(reentrant=True), tied_batch, tied_loss)
    for bucket in (None, 25.0):
        wrappers: list[DDP] = []

        def wrap(m: nn.Module, b: float | None = bucket, made: list[DDP] = wrappers) -> DDP:
            made.append(DDP(m, bucket_size_mb=b))
            return made[-1]

        model = train_ddp(wrap, lambda: TiedNet(reentrant=True), tied_batch, tied_loss, rank, world)
        out[f"reentrant/{bucket}"] = max_diff(model, reent_ref)
        out[f"rereductions/{bucket}"] = wrappers[0].late_rereductions

    # Differently initialised replicas (params and buffers) become rank 0's at construction.
    torch.manual_seed(100 + rank)
    net = TiedNet()
    net.scale.fill_(float(rank + 1))
    out["before"] = net.fc.weight.detach().tolist()  # plain lists: run_ranks cannot return tensors
    DDP(net)
    out["after"] = net.fc.weight.detach().tolist()
    out["scale_after"] = net.scale.tolist()
    return out


def _subgroup_worker(rank: int, world: int) -> dict[str, object]:
    """DDP over a DP subgroup ({0,1} and {2,3}): broadcast from the group's first rank, reduce inside it."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = rank // 2
    group = groups[pair]
    torch.manual_seed(50 + rank)
    net = make_mlp()
    before = net[0].weight.detach().tolist()
    model = DDP(net, bucket_size_mb=1e-3, process_group=group)
    after = net[0].weight.detach().tolist()
    # Each pair trains on its own data (offset seeds): the pairs must not mix.
    torch.manual_seed(0)
    ref_model = make_mlp()
    ref_model.load_state_dict(net.state_dict())
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = mlp_batch(100 * pair + step)
        opt.zero_grad()
        mlp_loss(model, local_slice(batch, rank % 2, 2)).backward()
        model.finish_gradient_synchronization()
        opt.step()
        ref_opt.zero_grad()
        mlp_loss(ref_model, batch).backward()
        ref_opt.step()
    pairs = zip(net.parameters(), ref_model.parameters(), strict=True)
    diff = max((p - q).abs().max().item() for p, q in pairs)
    out: dict[str, object] = {"before": before, "after": after, "diff": diff}
    # Every variant over the whole world of 4, with and without accumulation.
    mlp_ref = reference_params(make_mlp, mlp_batch, mlp_loss)
    for name, wrap in VARIANTS.items():
        out[f"mlp/{name}"] = max_diff(train_ddp(wrap, make_mlp, mlp_batch, mlp_loss, rank, world), mlp_ref)
        acc = train_ddp(wrap, make_mlp, mlp_batch, mlp_loss, rank, world, micro_batches=2)
        out[f"accum/{name}"] = max_diff(acc, mlp_ref)
    return out


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, object]]:
    return run_ranks(2, _ddp_worker)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_match_single_process(two_rank_results: list[dict[str, object]], name: str) -> None:
    for r, res in enumerate(two_rank_results):
        assert res["ref_moved"] > 1e-2
        assert res[f"mlp/{name}"] < TOL, (r, res[f"mlp/{name}"])
        assert res[f"tied/{name}"] < TOL, (r, res[f"tied/{name}"])
        assert res[f"tied_still_tied/{name}"]
        assert res[f"frozen_untouched/{name}"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradient_accumulation_with_no_sync(two_rank_results: list[dict[str, object]], name: str) -> None:
    for res in two_rank_results:
        assert res[f"accum/{name}"] < TOL


def test_bucket_layout_and_reentrant_accumulation(two_rank_results: list[dict[str, object]]) -> None:
    res = two_rank_results[0]
    assert res["buckets_none"] == 6  # one per parameter
    assert res["buckets_25mb"] == 1
    assert 1 < res["buckets_small"] < 6
    for r in two_rank_results:
        assert r["reentrant/None"] < TOL and r["reentrant/25.0"] < TOL
        # per-parameter buckets: fc.weight's bucket leaves before its second accumulation (path exercised)
        assert r["rereductions/None"] >= 1


def test_construction_broadcasts_rank0_state(two_rank_results: list[dict[str, object]]) -> None:
    r0, r1 = two_rank_results
    assert r0["before"] != r1["before"]
    assert r1["after"] == r0["before"] and r0["after"] == r0["before"]
    assert r1["scale_after"] == [1.0] * 8


def test_four_ranks_and_dp_subgroups() -> None:
    results = run_ranks(4, _subgroup_worker)
    assert results[1]["after"] == results[0]["before"]
    assert results[3]["after"] == results[2]["before"]  # group rank 0 of {2,3} is global rank 2
    assert results[2]["after"] != results[0]["after"]
    assert all(r["diff"] < TOL for r in results), [r["diff"] for r in results]
    for name in VARIANTS:
        for r in results:
            assert r[f"mlp/{name}"] < TOL, (name, r[f"mlp/{name}"])
            assert r[f"accum/{name}"] < TOL, (name, r[f"accum/{name}"])


def test_rejects_bad_bucket_size() -> None:
    with pytest.raises(ValueError, match="bucket_size_mb"):
        DDP(make_mlp(), bucket_size_mb=0)
