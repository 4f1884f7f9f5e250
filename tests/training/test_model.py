"""Single-process checks of the model, the stage split, the digest and the layout/model checks."""

from __future__ import annotations

import pytest
import torch

from training.config.arithmetic import flops_per_token, param_counts, total_params
from training.config.layout import Layout, LayoutError
from training.config.spec import ModelSpec
from training.config.validate import check_layout_for_model
from training.integrity.digest import state_digest
from training.model.transformer import (
    Transformer,
    build_model,
    cross_entropy_loss,
    prune_to_stage,
)
from training.parallel.pipeline import split_layers, stage_ids
from training.parallel.recompute import apply_recompute

GQA = ModelSpec(layers=3, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16)
TIED_GELU = ModelSpec(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, activation="gelu",
                      tied_embeddings=True)


@pytest.mark.parametrize("spec", [GQA, TIED_GELU], ids=["gqa_swiglu", "tied_gelu"])
def test_meta_build_materialises_to_the_same_weights(spec: ModelSpec) -> None:
    eager = build_model(spec, seed=7)
    with torch.device("meta"):
        lazy = Transformer(spec)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(7)
    eager_state, lazy_state = dict(eager.named_parameters()), dict(lazy.named_parameters())
    assert list(eager_state) == list(lazy_state)
    assert all(torch.equal(eager_state[k], lazy_state[k]) for k in eager_state)
    assert torch.equal(eager.rope_cos, lazy.rope_cos)
    other = build_model(spec, seed=8)
    assert not torch.equal(other.layers["0"].attention.wq.weight, eager.layers["0"].attention.wq.weight)


def test_canonical_names_and_parameter_count() -> None:
    model = build_model(GQA, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "tok_embeddings.weight" and names[-2:] == ["norm.weight", "output.weight"]
    assert "layers.2.feed_forward.w3.weight" in names
    assert model.layers["0"].attention.wk.weight.shape == (2 * 8, 32)  # GQA: kv_heads x head_dim
    assert sum(p.numel() for p in model.parameters()) == total_params(GQA)
    tied = build_model(TIED_GELU, seed=0)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert "output.weight" not in dict(tied.named_parameters())
    assert "layers.0.feed_forward.w3.weight" not in dict(tied.named_parameters())
    assert sum(p.numel() for p in tied.parameters()) == total_params(TIED_GELU)
    assert flops_per_token(GQA, GQA.seq_len) > 6 * (total_params(GQA) - param_counts(GQA).embed)


def test_attention_is_causal_and_loss_starts_near_log_vocab() -> None:
    model = build_model(GQA, seed=0)
    x = torch.randint(0, GQA.vocab, (2, GQA.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    assert logits.shape == (2, GQA.seq_len, GQA.vocab)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % GQA.vocab
    assert torch.equal(model(changed)[:, :-1], logits[:, :-1])
    assert not torch.equal(model(changed)[:, -1], logits[:, -1])
    assert abs(cross_entropy_loss(logits, x).item() - torch.log(torch.tensor(64.0)).item()) < 0.5


def test_pipeline_stage_keeps_canonical_names_and_weights() -> None:
    full = dict(build_model(GQA, seed=3).named_parameters())
    with torch.device("meta"):
        stage = Transformer(GQA)
    prune_to_stage(stage, [1, 2], first=False, last=True)
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    names = [n for n, _ in stage.named_parameters()]
    assert names[0].startswith("layers.1.") and names[-1] == "output.weight"
    assert stage.tok_embeddings is None and not any(n.startswith("layers.0.") for n in names)
    assert all(torch.equal(p, full[n]) for n, p in stage.named_parameters())
    h = torch.randn(2, GQA.seq_len, GQA.hidden)
    assert stage(h).shape == (2, GQA.seq_len, GQA.vocab)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_gradients(mode: str) -> None:
    x = torch.randint(0, GQA.vocab, (2, GQA.seq_len), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in ("none", mode):
        model = build_model(GQA, seed=0)
        apply_recompute(model, m)
        cross_entropy_loss(model(x), x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_split_layers_balanced_with_extras_in_the_middle() -> None:
    assert split_layers(4, 4) == [[0], [1], [2], [3]]
    assert [len(s) for s in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(s) for s in split_layers(7, 4)] == [2, 2, 2, 1]  # head + loss is the heavy end
    assert [len(s) for s in split_layers(9, 3)] == [3, 3, 3]
    assert sum(split_layers(13, 5), []) == list(range(13))
    with pytest.raises(LayoutError, match="model.layers"):
        split_layers(3, 4)


def test_stage_placement_loop_and_v() -> None:
    loop = Layout(pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=2)
    assert [stage_ids(loop, r) for r in range(2)] == [[0, 2], [1, 3]]
    v = Layout(pp=3, schedule="zbv_zero_bubble", virtual_stages=2, num_microbatches=3)
    assert [stage_ids(v, r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    flat = Layout(pp=4, schedule="1f1b", num_microbatches=4)
    assert [stage_ids(flat, r) for r in range(4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    ("spec", "layout", "field"),
    [
        (GQA, Layout(tp=4), "model.kv_heads"),
        (GQA, Layout(tp=3), "model.heads"),
        (ModelSpec(layers=2, hidden=32, heads=4, vocab=63, seq_len=16), Layout(tp=2), "model.vocab"),
        (ModelSpec(layers=2, hidden=32, heads=4, vocab=64, seq_len=15), Layout(tp=2, sequence_parallel=True),
         "model.seq_len"),
        (TIED_GELU, Layout(pp=2, schedule="1f1b", num_microbatches=2), "model.tied_embeddings"),
        (GQA, Layout(pp=2, schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=2),
         "model.layers"),
    ],
)
def test_layouts_that_cannot_split_the_model_are_refused(spec, layout, field) -> None:
    with pytest.raises(LayoutError, match=field):
        check_layout_for_model(spec, layout)


def test_digest_order_and_sensitivity() -> None:
    state = {n: p.detach().clone() for n, p in build_model(GQA, seed=0).named_parameters()}
    digest = state_digest(state)
    assert digest == state_digest(dict(state))
    flipped = {k: v.clone() for k, v in state.items()}
    flipped["norm.weight"].view(torch.int32)[0] ^= 1  # lowest mantissa bit
    assert state_digest(flipped) != digest
