"""Gradient SDC (training.integrity.gradient): the bucket checksum carried through the all-reduce and
the per-rank norm outliers against the DP peers, as pure math and on real gloo ranks running the
train loop with our DDP (flips of a local gradient before the reduction, of a reduced bucket after it).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from training.integrity.gradient import (
    GradientAudit,
    bucket_stats,
    checksum_mismatches,
    checksum_tolerance,
    norm_outliers,
    reduced_sum,
)
from training.integrity.injection import flip_bit

# ---- checksum math ---------------------------------------------------------------------------------


def _locals(world: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Gradients of mixed scale and sign (cancellation included), as ranks would pack them."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-8, 2, numel, dtype=torch.float64)[torch.randperm(numel, generator=g)]
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * scale).float() for _ in range(world)]


def _reduce(parts: list[torch.Tensor], seed: int) -> torch.Tensor:
    """A float32 all-reduce whose addition order differs per chunk (as a ring's does)."""
    rng = random.Random(seed)
    out = torch.empty_like(parts[0])
    for chunk in torch.arange(parts[0].numel()).chunk(len(parts)):
        order = rng.sample(range(len(parts)), len(parts))
        acc = parts[order[0]][chunk].clone()
        for r in order[1:]:
            acc += parts[r][chunk]
        out[chunk] = acc
    return out


def _judge(parts: list[torch.Tensor], reduced: list[torch.Tensor]) -> list[int]:
    local = [bucket_stats(p).tolist() for p in parts]
    sums = [float(reduced_sum(r)) for r in reduced]
    return [r for r, _, _ in checksum_mismatches(local, sums, len(parts), parts[0].dtype)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_clean_reductions_pass_the_checksum(world: int) -> None:
    for seed in range(25):
        numel = 1 + seed * 997  # multiples of the row width and not
        parts = _locals(world, numel, seed)
        reduced = _reduce(parts, seed)
        assert _judge(parts, [reduced] * world) == [], seed


def test_float64_and_bfloat16_buckets_pass_the_checksum() -> None:
    parts = _locals(3, 4099, seed=11)
    assert _judge([p.double() for p in parts], [_reduce([p.double() for p in parts], 11)] * 3) == []
    half = [p.bfloat16() for p in parts]
    assert _judge(half, [_reduce(half, 11)] * 3) == []


@pytest.mark.parametrize(("bit", "where"), [(30, 1234), (29, "grows"), (27, "grows"), (22, "largest"),
                                            (31, "largest"), (24, "largest")])
def test_a_corrupted_reduced_bucket_is_caught_and_the_rank_named(bit: int, where: str | int) -> None:
    world = 3
    parts = _locals(world, 5000, seed=7)
    reduced = _reduce(parts, seed=7)
    if where == "largest":
        index = int(reduced.abs().argmax())
    elif where == "grows":  # the largest element whose exponent bit is 0: the flip grows it
        clear = ((reduced.view(torch.int32) >> bit) & 1) == 0
        index = int((reduced.abs() * clear).argmax())
    else:
        index = int(where)
    bad = reduced.clone()
    flip_bit(bad, index, bit)
    assert _judge(parts, [reduced, bad, reduced]) == [1]  # only rank 1 received the corruption
    assert _judge(parts, [bad] * world) == [0, 1, 2]  # corrupted before the reduction: every rank


def test_a_non_finite_reduced_bucket_is_caught() -> None:
    parts = _locals(2, 300, seed=3)
    reduced = _reduce(parts, seed=3)
    nan = reduced.clone()
    nan[5] = float("nan")
    assert _judge(parts, [reduced, nan]) == [1]


def test_a_flip_below_rounding_is_not_flagged() -> None:
    """The tolerance is the rounding bound: a lowest-mantissa-bit flip of a small element is within it."""
    parts = _locals(2, 4096, seed=5)
    reduced = _reduce(parts, seed=5)
    small = int(reduced.abs().argmin())
    bad = reduced.clone()
    flip_bit(bad, small, 0)
    assert _judge(parts, [reduced, bad]) == []


def test_checksum_tolerance_grows_with_world_and_reduce_precision() -> None:
    assert checksum_tolerance(1.0, 8, torch.float32) > checksum_tolerance(1.0, 2, torch.float32)
    assert checksum_tolerance(1.0, 2, torch.bfloat16) > 10 * checksum_tolerance(1.0, 2, torch.float32)
    one = checksum_tolerance(1.0, 2, torch.float32)
    assert checksum_tolerance(2.0, 2, torch.float32) == pytest.approx(2 * one)


def test_bucket_stats_of_a_half_precision_bucket() -> None:
    x = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    total, abs_bound, norm, max_abs = bucket_stats(x).tolist()
    assert (total, max_abs) == (-0.25, 2.0) and norm == pytest.approx(2.5124689)
    assert 3.75 <= abs_bound == pytest.approx(2.5124689 * 3**0.5)  # sqrt(n) ||x|| >= sum|x|


def test_norm_outliers() -> None:
    assert norm_outliers([1.0, 1.3, 0.8], 8.0) == []
    assert norm_outliers([1.0, 1e30, 1.2], 8.0) == [1]
    assert norm_outliers([float("inf"), 1.0], 8.0) == [0]
    assert norm_outliers([float("nan"), 1.0, 2.0], 8.0) == [0]
    assert norm_outliers([float("inf"), float("inf")], 8.0) == []  # diverged alike: nobody's hardware
    assert norm_outliers([1.0, 9.0], 8.0) == [1]
    assert norm_outliers([1.0], 8.0) == []
    with pytest.raises(ValueError, match="factors"):
        GradientAudit.__init__(object.__new__(GradientAudit), None, {}, norm_factor=1.0)


# ---- the train loop on two gloo ranks ------------------------------------------------------------------

CLEAN_STEPS = 200
STEPS = 8
GRAD_FLIPS = {"exponent": 30, "mantissa": 22, "sign": 31}
TIMINGS = {"early": 1, "mid": 5}
LINEAR = "layers.0.feed_forward.w1.weight"


def _cfg(steps: int, abft: bool) -> Any:
    from training.config.layout import Layout
    from training.config.run import IntegrityConfig, RunConfig
    from training.config.spec import ModelSpec

    spec = ModelSpec(layers=1, hidden=16, heads=2, vocab=32, seq_len=8)
    return RunConfig(model=spec, layout=Layout(dp=2), steps=steps, seed=3,
                     integrity=IntegrityConfig(abft=abft))


def _run(rank: int, world: int, steps: int, flips: list[Any], checks: bool = True) -> dict[str, Any]:
    from training.integrity.attribution import AuditConfig
    from training.integrity.injection import BitFlipInjector
    from training.parallel.dist import DistContext
    from training.train import Action, Trainer, TrainHooks, train

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    state: dict[str, Any] = {}

    class Hooks(TrainHooks):
        def __init__(self) -> None:
            self.injector = BitFlipInjector(flips, rank) if flips else None
            self.audit = AuditConfig(grad_checks=checks)
            self.errors: list[dict[str, Any]] = []

        def on_integrity_error(self, error: Any) -> Action:
            self.errors.append({"kind": error.kind, "step": error.step, "ranks": error.ranks,
                                "transient": error.evidence.get("transient")})
            return Action.STOP

    original = Trainer.digest

    def digest(self: Any) -> str:
        state.update({k: v.detach().clone() for k, v in self.full_state().items()})
        return original(self)

    hooks = Hooks()
    Trainer.digest = digest  # type: ignore[method-assign]
    try:
        result = train(ctx, _cfg(steps, abft=checks), hooks, resume=False)
    finally:
        Trainer.digest = original  # type: ignore[method-assign]
    return {"errors": hooks.errors, "digest": result.model_digest, "state": state,
            "applied": len(hooks.injector.applied) if hooks.injector else 0}


def _within_tolerance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # The repo's run-to-run tolerance: what a replan to another layout keeps (test_replan_layouts.py).
    return all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-4) for k in b)


def _worker(rank: int, world: int) -> dict[str, Any]:
    from training.integrity.injection import BitFlip

    out: dict[str, Any] = {}
    long_clean = _run(rank, world, CLEAN_STEPS, [])
    out["clean_errors"] = long_clean["errors"]
    clean = _run(rank, world, STEPS, [])
    off = _run(rank, world, STEPS, [], checks=False)
    out["digests"] = (clean["digest"], off["digest"])
    out["grad"] = {}
    for cls, bit in GRAD_FLIPS.items():
        for timing, step in TIMINGS.items():
            flip = BitFlip(step=step, rank=1, target="grad", name=LINEAR, index=37, bit=bit)
            res = _run(rank, world, STEPS, [flip])
            out["grad"][f"{cls}-{timing}"] = {"errors": res["errors"], "applied": res["applied"],
                                               "harmless": _within_tolerance(res["state"], clean["state"])}
    # Corruption in the communication: rank 0's reduced bucket, after the local checksums were taken.
    flip = BitFlip(step=3, rank=0, target="reduce", name=LINEAR, index=11, bit=30)
    out["reduce"] = _run(rank, world, STEPS, [flip])["errors"]
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(2, _worker, timeout_s=600)


def test_no_false_positives_in_clean_steps(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["clean_errors"] == []


def test_checks_leave_clean_results_bit_identical(results: list[dict[str, Any]]) -> None:
    for r in results:
        with_checks, without = r["digests"]
        assert with_checks == without


@pytest.mark.parametrize("cell", [f"{c}-{t}" for c in GRAD_FLIPS for t in TIMINGS])
def test_gradient_flip_is_detected_and_named_or_harmless(results: list[dict[str, Any]], cell: str) -> None:
    assert results[1]["grad"][cell]["applied"] == 1
    for r in results:
        res = r["grad"][cell]
        if res["errors"]:
            first = res["errors"][0]
            assert first["ranks"] == [1] and first["step"] == TIMINGS[cell.split("-")[1]]
            assert first["kind"] in ("grad_norm_outlier", "grad_abft") and first["transient"] is True
        else:
            assert res["harmless"], f"{cell}: undetected and beyond the run-to-run tolerance"
    # x 2^128 stands out against the peers; sign and mantissa flips keep the scale and are caught by
    # the linear layers' checksums (integrity.abft): both are detected here, not just harmless.
    assert all(r["grad"][cell]["errors"] for r in results)
    if not cell.startswith("exponent"):
        assert all(r["grad"][cell]["errors"][0]["kind"] == "grad_abft" for r in results)


def test_reduced_bucket_corruption_is_caught_by_the_checksum(results: list[dict[str, Any]]) -> None:
    for r in results:
        first = r["reduce"][0]
        assert first["kind"] == "grad_checksum" and first["ranks"] == [0] and first["step"] == 3


# ---- ABFT of the linear layers' weight gradients ---------------------------------------------------------


def _abft_model() -> tuple[torch.nn.Module, Any]:
    from training.integrity.abft import GradABFT

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24, bias=False))
    return model, GradABFT(model)


def test_abft_passes_clean_gradients_accumulated_over_micro_batches() -> None:
    model, abft = _abft_model()
    for step in range(20):
        for _mb in range(3):
            x = torch.randn(4, 16, 24) * (10.0 ** (step % 5 - 2))  # scales from 1e-2 to 1e2
            model(x).pow(2).mean().backward()
        assert abft.verify(step, rank=0) is None, step
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bit", [31, 22, 23, 30])
def test_abft_catches_a_flipped_weight_gradient_element(bit: int) -> None:
    model, abft = _abft_model()
    model(torch.randn(8, 24)).pow(2).mean().backward()
    grad = model[2].weight.grad
    flip_bit(grad, int(grad.abs().argmax()), bit)  # sign, mantissa, exponent of one element
    error = abft.verify(3, rank=5)
    assert error is not None and error.kind == "grad_abft" and error.ranks == [5]
    assert error.evidence["layer"] == "2"


def test_abft_skips_tied_weights_and_reads_only() -> None:
    from training.integrity.abft import GradABFT

    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied: the embedding adds to the same gradient
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "proj": torch.nn.Linear(8, 8)})
    abft = GradABFT(model)
    assert [name for name, _ in abft.layers.values()] == ["proj"]
    x = torch.randn(5, 8)
    out = model["proj"](x)
    out.sum().backward()
    before = model["proj"].weight.grad.clone()
    assert abft.verify(0, 0) is None
    assert torch.equal(model["proj"].weight.grad, before)


def _embedding_model() -> tuple[torch.nn.Module, Any]:
    from training.integrity.abft import GradABFT
    from training.model.transformer import RMSNorm

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 24), RMSNorm(24, 1e-5), torch.nn.Linear(24, 50))
    return model, GradABFT(model)


def test_abft_covers_embeddings_and_norms_without_false_positives() -> None:
    model, abft = _embedding_model()
    assert [name for name, _ in abft.layers.values()] == ["0", "1", "2"]
    g = torch.Generator().manual_seed(2)
    for step in range(20):
        for _mb in range(2):
            tokens = torch.randint(0, 50, (4, 12), generator=g)
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        assert abft.verify(step, rank=0) is None, step
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize(("layer", "bit", "where"), [("0", 30, "unused row"), ("0", 31, "largest"),
                                                     ("1", 31, "largest"), ("1", 22, "largest")])
def test_abft_catches_embedding_and_norm_gradient_flips(layer: str, bit: int, where: str) -> None:
    model, abft = _embedding_model()
    tokens = torch.arange(10).view(2, 5)  # rows 10..49 of the embedding get no gradient
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    grad = model[int(layer)].weight.grad
    index = 40 * 24 + 3 if where == "unused row" else int(grad.abs().argmax())
    flip_bit(grad, index, bit)  # 0.0 -> 2.0 in an unused row: no norm check can see it
    error = abft.verify(1, rank=2)
    assert error is not None and error.evidence["layer"] == layer and error.ranks == [2]


def test_job_spec_flag_turns_on_abft() -> None:
    from service.schemas import DEMO_SPEC, JobSpec
    from training.config.layout import Layout

    on = JobSpec.model_validate({**DEMO_SPEC, "fault_tolerance": {"sdc_abft": True}})
    assert on.to_run_config(Layout(dp=2), None).integrity.abft is True
    assert JobSpec.model_validate(DEMO_SPEC).to_run_config(Layout(dp=2), None).integrity.abft is False


# ---- the probabilistic tolerance at realistic sizes ------------------------------------------------------


def _linear_grad(t: int, n_in: int, n_out: int, seed: int, coherent: bool = False) -> tuple[Any, Any]:
    from training.integrity.abft import GradABFT

    torch.manual_seed(seed)
    lin = torch.nn.Linear(n_in, n_out, bias=False)
    abft = GradABFT(lin)
    if coherent:  # every output gradient positive, inputs with a common offset: the rows add up
        x, dy = torch.randn(t, n_in) * 0.1 + 3.0, torch.rand(t, n_out) + 1.0
    else:
        x, dy = torch.randn(t, n_in), torch.randn(t, n_out)
    lin(x).backward(dy)
    return lin, abft


@pytest.mark.parametrize("coherent", [False, True])
def test_abft_tolerance_has_no_false_positives_at_1024_tokens(coherent: bool) -> None:
    for seed in range(3):
        _, abft = _linear_grad(1024, 256, 1024, seed, coherent)
        assert abft.verify(0, rank=0) is None
        assert 0.0 < abft.worst < 0.5  # measured <= 0.04: the margin the bound keeps


def test_abft_catches_a_sign_flip_of_a_small_element_at_1024_tokens() -> None:
    # The worst-case bound needed a change of ~8x the column's RMS element at this size (a sign
    # flip of a typical element passed); the probabilistic one fires at ~0.04x.
    for column in (0, 77, 255):
        lin, abft = _linear_grad(1024, 256, 1024, seed=column, coherent=False)
        g = lin.weight.grad
        col = g[:, column]
        row = int((col.abs() - 0.1 * col.pow(2).mean().sqrt()).abs().argmin())  # |G| ~ RMS / 10
        flip_bit(g, row * g.shape[1] + column, 31)
        error = abft.verify(0, rank=1)
        assert error is not None and error.kind == "grad_abft" and error.evidence["column"] == column


def test_abft_bf16_gradients_pass_clean_and_catch_a_sign_flip() -> None:
    from training.integrity.abft import GradABFT
    from training.model.transformer import RMSNorm

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), RMSNorm(32, 1e-5), torch.nn.Linear(32, 64)
                                ).to(torch.bfloat16)
    abft = GradABFT(model)
    g = torch.Generator().manual_seed(5)
    for step in range(11):
        model.zero_grad(set_to_none=True)
        for _mb in range(2):
            tokens = torch.randint(0, 64, (4, 32), generator=g)
            logits = model(tokens).float().flatten(0, 1)
            torch.nn.functional.cross_entropy(logits, tokens.flatten()).backward()
        if step < 10:
            assert abft.verify(step, rank=0) is None, step
    grad = model[2].weight.grad
    flip_bit(grad, int(grad.abs().argmax()), 15)  # bf16's sign bit
    error = abft.verify(10, rank=0)
    assert error is not None and error.evidence["layer"] == "2"
