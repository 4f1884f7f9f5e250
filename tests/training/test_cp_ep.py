"""Context parallel and expert parallel inside the full model and train loop.

One 4-rank gloo spawn runs every distributed case; each trains N = 2 optimizer steps and is
compared with one process on the same global batch (initial weights bitwise equal, final ones
allclose at 1e-5; eps = 1e-5 as in test_parallel.py, for the same reason).

The MoE reference reproduces what the distributed run computes, not an idealised model: an MoE
layer's capacity, dropping order and aux loss are defined over its EP group's tokens of one
micro-batch (training/model/moe.py). So the reference runs, for each micro-batch and each EP group, the
group's sequences (its DP ranks' micro-batches concatenated in rank order) as one batch, and
averages: loss = mean over (micro-batch, group) of CE + aux_loss_coef x sum of aux. That is the
objective the layout optimises, and for a single EP group over the whole batch it is the plain
full-batch model. Dropped-token counts and aux values of the last micro-batch are compared too.
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import dataclass, replace

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout, LayoutError
from training.config.run import CheckpointConfig, OptimConfig, RunConfig
from training.config.spec import ModelSpec

WORLD = 4
STEPS = 2
ATOL = 1e-5
OPTIM = OptimConfig(lr=3e-3, eps=1e-5)

DENSE = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=64)
# capacity 0.5: each expert takes half its fair share, so tokens are dropped in every step.
MOE = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, num_experts=4,
                top_k=2, expert_ffn=32, capacity_factor=0.5)
MOE_NO_DROP = replace(MOE, capacity_factor=None)
MOE_EVERY_2 = replace(MOE, layers=4, moe_layer_freq=2)  # blocks 1 and 3 are MoE
SPECS = {"dense": DENSE, "moe": MOE, "moe_nodrop": MOE_NO_DROP, "moe_every2": MOE_EVERY_2}


@dataclass(frozen=True)
class Case:
    id: str
    spec: str
    layout: dict
    grad_clip: float | None = None


CASES = [
    Case("cp2_dp2", "dense", {"cp": 2, "dp": 2, "micro_batch_size": 2}),
    Case("cp2_tp2_sp_selective", "dense", {"cp": 2, "tp": 2, "sequence_parallel": True,
                                           "recompute": "selective", "micro_batch_size": 2}),
    Case("cp4_fsdp3_clip", "dense", {"cp": 4, "zero_stage": 3, "micro_batch_size": 2}, grad_clip=0.5),
    Case("cp2_dp2_zero1_accum", "dense", {"cp": 2, "dp": 2, "zero_stage": 1, "num_microbatches": 2}),
    Case("cp2_pp2_1f1b", "dense", {"cp": 2, "pp": 2, "schedule": "1f1b", "num_microbatches": 2}),
    Case("ep2_dp4_drop", "moe", {"dp": 4, "ep": 2}),
    Case("ep4_dp4_drop_clip", "moe", {"dp": 4, "ep": 4}, grad_clip=0.5),
    Case("ep2_dp4_zero1_accum_every2", "moe_every2", {"dp": 4, "ep": 2, "zero_stage": 1,
                                                      "num_microbatches": 2}),
    Case("ep2_dp2_pp2_1f1b", "moe", {"dp": 2, "ep": 2, "pp": 2, "schedule": "1f1b", "num_microbatches": 2}),
    Case("ep2_cp2_dp2_nodrop", "moe_nodrop", {"dp": 2, "cp": 2, "ep": 2}),
    Case("moe_ep1_fsdp2_drop", "moe", {"dp": 4, "zero_stage": 2}),
]


def _config(case: Case, **kw) -> RunConfig:
    return RunConfig(model=SPECS[case.spec], layout=Layout(**case.layout), steps=STEPS,
                     optim=replace(OPTIM, grad_clip=case.grad_clip), **kw)


def _ep_groups(layout: Layout) -> list[list[int]]:
    """The DP ranks whose sequences one MoE layer routes together (its EP group's tokens)."""
    if layout.ep == 1:
        assert layout.cp == 1, "an EP group of one CP rank holds part of a sequence: no reference"
        return [[d] for d in range(layout.dp)]
    assert layout.ep % layout.cp == 0
    per = layout.ep // layout.cp
    return [list(range(g * per, (g + 1) * per)) for g in range(layout.dp // per)]


def _reference(cfg: RunConfig) -> dict:
    """One process, the whole model, the same objective (module docstring)."""
    from training.data.sources import make_data_source
    from training.model.transformer import build_model, cross_entropy_loss

    lay, spec = cfg.layout, cfg.model
    model = build_model(spec, cfg.seed)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                            weight_decay=o.weight_decay)
    data = make_data_source(cfg.data, spec, cfg.global_batch)
    groups = _ep_groups(lay) if spec.is_moe else [list(range(lay.dp))]
    n, parts = lay.num_microbatches, lay.num_microbatches * len(groups)
    model.set_aux_loss_scale(spec.aux_loss_coef / parts)
    losses, norms, stats = [], [], []
    for step in range(1, cfg.steps + 1):
        slices = [data.batch(step, r, lay.dp) for r in range(lay.dp)]
        total = 0.0
        for i in range(n):
            stats = []
            for g in groups:
                x = torch.cat([slices[r][0].chunk(n)[i] for r in g])
                y = torch.cat([slices[r][1].chunk(n)[i] for r in g])
                loss = cross_entropy_loss(model(x), y) / parts
                loss.backward()
                total += loss.item()
                stats.append([(m.last_stats.dropped_group, m.last_stats.aux_loss)
                              for m in model.moe_layers()])
        if o.grad_clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    assert all(nm > o.grad_clip for nm in norms), norms  # the clip must be active to be tested
    final = {k: p.detach().clone() for k, p in model.named_parameters()}
    return {"init": init, "final": final, "losses": losses, "stats": stats, "groups": groups}


def _run_case(rank: int, ctx, case: Case) -> dict:
    from training.integrity.digest import state_digest
    from training.train import Trainer

    cfg = _config(case)
    trainer = Trainer(ctx, cfg)
    init = trainer.full_state()
    losses = [trainer.train_step(step)[0] for step in range(1, STEPS + 1)]
    final = trainer.full_state()
    moe = [m for part in trainer.parts for m in part.moe_layers()]
    out = {"losses": losses, "digest": state_digest(final), "coord": trainer.dims.coord,
           "moe": [(m.last_stats.dropped_group, m.last_stats.aux_loss) for m in moe],
           "moe_names": [n for part in trainer.parts for n, mod in part.named_modules() if mod in moe]}
    if rank == 0:
        ref = _reference(cfg)
        out["names_match"] = sorted(init) == sorted(ref["init"])
        out["init_equal"] = all(torch.equal(init[k], ref["init"][k]) for k in ref["init"])
        out["max_diff"] = max((final[k] - ref["final"][k]).abs().max().item() for k in ref["final"])
        out["ref_losses"] = ref["losses"]
        out["ref_stats"] = ref["stats"]
        out["ref_groups"] = ref["groups"]
    return out


def _train_loop_checks(rank: int, ctx, root: str) -> dict:
    """An MoE model learns under EP; an EP x ZeRO-1 checkpoint resumes to the same weights."""
    from training.train import Action, TrainHooks, train

    out: dict = {}
    falls = RunConfig(model=replace(MOE, capacity_factor=1.25), layout=Layout(dp=4, ep=4),
                      steps=8, optim=OptimConfig(lr=1e-2))
    out["falling"] = train(ctx, falls).losses

    class StopAt(TrainHooks):
        def __init__(self, step: int | None) -> None:
            self.stop = step

        def on_step(self, info):
            return Action.STOP if info.step == self.stop else None

    layout = Layout(dp=4, ep=2, zero_stage=1)
    whole = RunConfig(model=MOE, layout=layout, steps=4, optim=OPTIM,
                      checkpoint=CheckpointConfig(dir=f"{root}/a", every_steps=2))
    full = train(ctx, whole, StopAt(None))
    cut = replace(whole, checkpoint=CheckpointConfig(dir=f"{root}/b", every_steps=2))
    first = train(ctx, cut, StopAt(2))
    second = train(ctx, cut, StopAt(None))
    out["resume"] = (full.model_digest, full.losses, first.final_step, second.resumed_from,
                     second.model_digest, first.losses + second.losses)
    return out


def _worker(rank: int, world: int, root: str) -> dict:
    from training.parallel.dist import DistContext

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    results: dict = {}
    for case in CASES:
        try:
            results[case.id] = _run_case(rank, ctx, case)
        except Exception:  # noqa: BLE001 - reported per case; the other cases still run
            results[case.id] = {"error": traceback.format_exc()}
    try:
        results["train_loop"] = _train_loop_checks(rank, ctx, root)
    except Exception:  # noqa: BLE001 - reported with its traceback; the case results still come back
        results["train_loop"] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_ranks(WORLD, _worker, (str(tmp_path_factory.mktemp("ckpt")),), timeout_s=900)


def _case(results: list[dict], cid: str) -> list[dict]:
    per_rank = [r[cid] for r in results]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_matches_single_process(results, case: Case) -> None:
    per_rank = _case(results, case.id)
    r0 = per_rank[0]
    assert r0["names_match"]
    assert r0["init_equal"], "initial weights differ from the single-process model"
    assert r0["max_diff"] <= ATOL, f"max |param - reference| = {r0['max_diff']:.3g}"
    assert all(r["losses"] == r0["losses"] for r in per_rank)
    assert r0["losses"] == pytest.approx(r0["ref_losses"], abs=1e-5)
    assert len({r["digest"] for r in per_rank}) == 1
    if not SPECS[case.spec].is_moe:
        return
    # The last micro-batch's dropped counts and aux losses, per EP group, equal the reference's.
    layout = Layout(**case.layout)
    ref_stats, groups = r0["ref_stats"], r0["ref_groups"]
    for g, dp_ranks in enumerate(groups):
        members = [r for r in per_rank if r["coord"].dp in dp_ranks and r["moe"]]
        by_name: dict[str, list[tuple[int, float]]] = {}
        for r in members:
            for name, stat in zip(r["moe_names"], r["moe"], strict=True):
                by_name.setdefault(name, []).append(stat)
        names = sorted(by_name, key=lambda s: int(s.split(".")[1]))
        assert len(names) == SPECS[case.spec].num_moe_layers
        for layer, name in enumerate(names):
            stats = by_name[name]
            assert len(stats) == len(dp_ranks) * layout.cp
            ref_dropped, ref_aux = ref_stats[g][layer]
            assert {d for d, _ in stats} == {ref_dropped}, (name, stats, ref_stats[g][layer])
            # mean over the EP group of aux_r is the group's aux loss (training/model/moe.py)
            assert sum(a for _, a in stats) / len(stats) == pytest.approx(ref_aux, rel=1e-5)
    if SPECS[case.spec].capacity_factor is not None:
        assert any(d > 0 for grp in ref_stats for d, _ in grp), "the case must drop tokens"


def test_moe_loss_falls_under_expert_parallel(results) -> None:
    losses = _case(results, "train_loop")[0]["falling"]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.9 * losses[0], losses


def test_expert_parallel_checkpoint_resumes_to_the_same_weights(results) -> None:
    per_rank = _case(results, "train_loop")
    digest, losses, stopped, resumed_from, resumed_digest, resumed_losses = per_rank[0]["resume"]
    assert (stopped, resumed_from) == (2, 2)
    assert resumed_digest == digest and resumed_losses == losses
    assert all(r["resume"] == per_rank[0]["resume"] for r in per_rank)


# ---- single process -------------------------------------------------------------------------------


def test_aux_loss_gradient_equals_the_explicit_objective() -> None:
    """The injected aux gradient is exactly that of CE + coef x sum(aux), and a scale of 0 removes it."""
    from training.model.transformer import build_model, cross_entropy_loss

    x = torch.randint(0, MOE.vocab, (4, MOE.seq_len), generator=torch.Generator().manual_seed(0))
    model = build_model(MOE, seed=3)
    cross_entropy_loss(model(x), x).backward()
    injected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_aux_loss_scale(0.0)
    auxes: list[torch.Tensor] = []
    h = model.tok_embeddings(x)
    for block in model.layers.values():
        h = h + block.attention(block.attention_norm(h), model.rope_cos, model.rope_sin)
        y, aux = block.feed_forward(block.ffn_norm(h))
        auxes.append(aux)
        h = h + y
    explicit = cross_entropy_loss(model.output(model.norm(h)), x) + MOE.aux_loss_coef * sum(auxes)
    explicit.backward()
    router = "layers.0.feed_forward.router.weight"
    assert all(torch.allclose(injected[n], p.grad, atol=1e-7, rtol=0) for n, p in model.named_parameters())
    model.zero_grad()
    cross_entropy_loss(model(x), x).backward()  # scale 0: the router learns only from the output
    assert not torch.allclose(model.get_parameter(router).grad, injected[router], atol=1e-7, rtol=0)
    assert model.aux_losses() == pytest.approx([a.item() for a in auxes])


def test_moe_model_meta_build_parameter_count_and_flops() -> None:
    from training.config.arithmetic import flops_per_token, total_params
    from training.model.transformer import Transformer, build_model

    eager = build_model(MOE_EVERY_2, seed=5)
    with torch.device("meta"):
        lazy = Transformer(MOE_EVERY_2)
    lazy.to_empty(device="cpu")
    lazy.init_weights(5)
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in lazy.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), lazy.parameters(), strict=True))
    assert [b.is_moe for b in eager.layers.values()] == [False, True, False, True]
    assert eager.layers["1"].feed_forward.w_up.shape == (4, 32, 32)
    assert sum(p.numel() for p in eager.parameters()) == total_params(MOE_EVERY_2)
    # Only the top_k of num_experts experts count towards the FLOPs (active parameters): each of the
    # 2 MoE blocks trades the dense MLP (3 x 32 x 128) for 2 experts (3 x 32 x 32 each) + the router.
    dense = replace(MOE_EVERY_2, num_experts=0)
    per_block = 2 * 3 * 32 * 32 + 32 * 4 - 3 * 32 * 128
    seq = MOE_EVERY_2.seq_len
    expected = flops_per_token(dense, seq) + 2 * 6.0 * per_block
    assert flops_per_token(MOE_EVERY_2, seq) == pytest.approx(expected)


def test_sharded_loss_is_the_full_sequence_mean() -> None:
    """Mean of the CP ranks' losses on their shards is the full-sequence loss (equal shard sizes)."""
    from training.model.transformer import cross_entropy_loss, sharded_cross_entropy
    from training.parallel.context import shard_sequence

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 16, 10, generator=g), torch.randint(0, 10, (2, 16), generator=g)
    for cp in (2, 4):
        parts = [sharded_cross_entropy(shard_sequence(logits, r, cp, dim=1), targets, r, cp)
                 for r in range(cp)]
        assert torch.stack(parts).mean().item() == pytest.approx(cross_entropy_loss(logits, targets).item())


@pytest.mark.parametrize(
    ("spec", "layout", "field"),
    [
        (MOE, Layout(tp=2), "layout.tp"),
        (DENSE, Layout(dp=2, ep=2), "layout.ep"),
        (replace(MOE, num_experts=6, top_k=2), Layout(dp=4, ep=4), "layout.ep"),
        (MOE, Layout(dp=2, ep=2, zero_stage=2), "layout.zero_stage"),
        (replace(DENSE, seq_len=12), Layout(cp=4), "layout.cp"),
        (replace(DENSE, kv_heads=4, seq_len=12), Layout(cp=2, tp=4, sequence_parallel=True),
         "model.seq_len / layout.cp"),
    ],
)
def test_layouts_that_cannot_split_the_model_are_refused(spec, layout, field) -> None:
    from training.config.validate import check_layout_for_model

    with pytest.raises(LayoutError, match=field):
        check_layout_for_model(spec, layout)
