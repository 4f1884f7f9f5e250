"""Context parallel and expert parallel in the planner: formulas, presets, and the choices that emerge."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.planner import (
    ClusterSpec,
    Layout,
    ModelSpec,
    PlannerError,
    TrainSpec,
    evaluate,
    flops_per_token,
    get_preset,
    param_counts,
    plan,
    total_params,
)
from service.planner.formulas import (
    activation_bytes_per_layer,
    cp_ring_bytes_per_layer,
    ep_all_to_all_bytes_per_layer,
)
from service.planner.reference import reference_best

H100 = "H100-80GB"


# ---- formulas ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_ring_bytes_are_what_the_ring_sends(cp: int):
    """docs/context_parallel.md: fwd (cp-1) K/V blocks, bwd (cp-1) K/V + cp fp32 dK/dV accumulators."""
    kv = 1000.0
    assert cp_ring_bytes_per_layer(kv, cp, grad_bytes_ratio=1.0) == (3 * cp - 2) * kv  # fp32 activations
    assert cp_ring_bytes_per_layer(kv, cp) == (4 * cp - 2) * kv  # bf16 activations, fp32 accumulators
    assert cp_ring_bytes_per_layer(kv, 1) == 0.0


def test_evaluate_charges_the_ring_per_layer_and_micro_batch():
    m = get_preset("llama3-8b")
    train, cluster = TrainSpec(16, 32768), ClusterSpec(H100, 16)
    lay = Layout(tp=2, cp=4, dp=2, micro_batch_size=2, num_microbatches=4, sequence_parallel=True)
    p = evaluate(m, train, cluster, lay)
    kv_local = 2 * (2 * 32768 // 4) * m.n_kv_heads * m.head_dim * 2 / 2  # K+V of s/cp tokens, bf16, /tp
    assert p.comm_bytes_per_step["cp"] == pytest.approx(4 * m.layers * (4 * 4 - 2) * kv_local, rel=1e-12)
    assert p.link_tiers["cp"] == "intra-node"  # tp x cp = 8 ranks: one node


def test_ring_attention_keeps_no_scores():
    """With CP the per-layer activations are the s/cp share without the s x s score term."""
    s, b, h, a = 32768, 1, 4096, 32
    full = activation_bytes_per_layer(s, b, h, a)
    for cp in (2, 4):
        ring = activation_bytes_per_layer(s // cp, b, h, a, s_kv=s, ring_attention=True)
        assert ring == pytest.approx(s // cp * b * h * (34 + 4 * a / h))
        assert ring < full / cp


def test_ep_all_to_all_bytes_and_moe_flops():
    # dispatch + combine, forward + backward: 4 x tokens x top_k x h x 2 bytes x (ep-1)/ep
    assert ep_all_to_all_bytes_per_layer(100, 2, 10, 4) == pytest.approx(4 * 100 * 2 * 10 * 2 * 3 / 4)
    assert ep_all_to_all_bytes_per_layer(100, 2, 10, 1) == 0.0
    mix = get_preset("mixtral-8x7b")
    c = param_counts(mix)
    active = mix.layers * c.matmul_active_per_layer + c.embed  # Mixtral paper: 12.9B active of 46.7B
    assert active / 1e9 == pytest.approx(12.9, rel=0.02)
    assert total_params(mix) / 1e9 == pytest.approx(46.7, rel=0.01)
    # FLOPs count the active experts only: 6 per active weight (plus attention and head)
    attn = 12.0 * mix.layers * mix.hidden * 4096
    assert flops_per_token(mix, 4096) == pytest.approx(6 * (active - c.embed + c.embed) + attn, rel=1e-9)
    dense_same_total = replace(mix, num_experts=0, ffn=8 * 14336)
    assert flops_per_token(mix, 4096) < 0.35 * flops_per_token(dense_same_total, 4096)


def test_deepseek_v3_preset_is_close_to_the_paper():
    ds = get_preset("deepseek-v3")
    c = param_counts(ds)
    assert (ds.layers, ds.hidden, ds.heads, ds.num_experts, ds.top_k, ds.expert_ffn, ds.vocab) == (
        61,
        7168,
        128,
        256,
        8,
        2048,
        129280,
    )
    # DeepSeek-V3 report: 671B total, 37B active; MLA as plain attention, no shared expert (presets.py).
    assert total_params(ds) / 1e9 == pytest.approx(671, rel=0.05)
    assert (ds.layers * c.matmul_active_per_layer + c.embed + c.head) / 1e9 == pytest.approx(37, rel=0.05)


def test_moe_layer_frequency_averages_the_blocks():
    every = ModelSpec(layers=4, hidden=64, heads=4, vocab=100, seq_len=64, num_experts=4, top_k=2, ffn=128)
    half = replace(every, moe_layer_freq=2)
    dense = replace(every, num_experts=0)
    assert total_params(half) == (total_params(every) + total_params(dense)) // 2
    assert param_counts(half).moe_fraction == 0.5


def test_expert_memory_per_gpu_falls_with_ep():
    mix, train, cluster = get_preset("mixtral-8x7b"), TrainSpec(64, 4096), ClusterSpec(H100, 64)
    base = Layout(dp=64, zero_stage=1, recompute="full")
    params = {
        ep: evaluate(mix, train, cluster, base.with_(ep=ep)).memory_per_gpu_bytes["params"]
        for ep in (1, 2, 8)
    }
    c = param_counts(mix)
    for ep in (2, 8):  # bf16 params: experts / ep, the rest replicated
        assert params[1] - params[ep] == pytest.approx(2 * mix.layers * c.experts * (1 - 1 / ep), rel=1e-9)


# ---- choices that emerge -------------------------------------------------------------------------


def test_long_sequences_get_context_parallel_instead_of_recomputation():
    """llama3-8b at 131072 tokens on 8-GPU H100 nodes: CP splits the sequence; without it the same
    GPUs cannot hold the activations unless every layer is recomputed (or not at all)."""
    m = replace(get_preset("llama3-8b"), seq_len=131072)
    train, cluster = TrainSpec(64, 131072), ClusterSpec(H100, 64)
    p = plan(m, train, cluster)
    lay = p.layout
    assert lay.cp > 1 and lay.recompute == "none" and p.fits
    assert p.link_tiers["cp"] != "inter-rack"  # tp x cp inside a node or a rack
    assert p.comm_bytes_per_step["cp"] > 0
    folded = lay.with_(cp=1, dp=lay.dp * lay.cp, num_microbatches=lay.num_microbatches // lay.cp)
    for rc in ("none", "selective"):
        assert not evaluate(m, train, cluster, folded.with_(recompute=rc)).fits
    full = evaluate(m, train, cluster, folded.with_(recompute="full"))
    assert not full.fits or full.step_time_s > p.step_time_s


def test_short_sequences_get_no_context_parallel():
    p = plan(get_preset("llama3-8b"), TrainSpec(256, 2048), ClusterSpec(H100, 64))
    assert p.layout.cp == 1  # MIN_CP_TOKENS: a 2048-token sequence is not split


@pytest.mark.parametrize(
    "preset,batch,gpus",
    [("mixtral-8x7b", 256, 64), ("deepseek-v3", 4096, 2048)],
)
def test_moe_models_split_the_experts_with_ep_not_tp(preset: str, batch: int, gpus: int):
    """The experts are split mostly by EP; giving that split to TP instead is slower."""
    m = get_preset(preset)
    train, cluster = TrainSpec(batch, m.seq_len), ClusterSpec(H100, gpus)
    p = plan(m, train, cluster)
    lay = p.layout
    assert lay.ep > 1 and lay.ep > lay.tp
    assert m.num_experts % lay.ep == 0 and (lay.dp * lay.cp) % lay.ep == 0
    assert p.comm_bytes_per_step["ep"] > 0
    # The same GPUs with the expert split given to TP (the DP replicas that EP spanned become TP ranks).
    assert lay.dp % lay.ep == 0 and lay.tp * lay.ep <= cluster.gpn and m.n_kv_heads % (lay.tp * lay.ep) == 0
    as_tp = lay.with_(
        tp=lay.tp * lay.ep,
        ep=1,
        dp=lay.dp // lay.ep,
        sequence_parallel=True,
        num_microbatches=lay.num_microbatches * lay.ep,
    )
    wide = evaluate(m, train, cluster, as_tp)
    assert not wide.fits or wide.step_time_s > p.step_time_s


# ---- properties with the new axes -------------------------------------------------------------------


@st.composite
def moe_or_long(draw: st.DrawFn) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    heads = draw(st.sampled_from([4, 8, 16, 32]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    experts = draw(st.sampled_from([0, 4, 8, 16, 64]))
    seq = draw(st.sampled_from([2048, 8192, 32768, 131072]))
    model = ModelSpec(
        layers=draw(st.integers(2, 48)), hidden=heads * head_dim, heads=heads,
        kv_heads=draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0])),
        vocab=draw(st.integers(1000, 130_000)), seq_len=seq, num_experts=experts,
        top_k=draw(st.integers(1, 2)) if experts else 2, expert_ffn=draw(st.sampled_from([256, 1024, 4096])),
        moe_layer_freq=draw(st.sampled_from([1, 2])),
    )  # fmt: skip
    gpn = draw(st.sampled_from([4, 8]))
    gpus = gpn * draw(st.sampled_from([1, 2, 4, 8]))
    gpu = draw(st.sampled_from(["H100-80GB", "A100-80GB"]))
    cluster = ClusterSpec(gpu, gpus, gpn, nodes_per_rack=draw(st.sampled_from([1, 2])))
    train = TrainSpec(draw(st.sampled_from([8, 32, 128])), seq)
    return model, train, cluster


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(moe_or_long())
def test_every_plan_with_cp_and_ep_satisfies_every_constraint(problem) -> None:
    model, train, cluster = problem
    try:
        p = plan(model, train, cluster, top_k=2)
    except PlannerError as e:
        assert "fits no layout" in str(e)
        return
    lay = p.layout
    assert lay.world_size == cluster.num_gpus and lay.global_batch == train.global_batch
    assert train.seq_len % lay.cp == 0 and (lay.cp == 1 or train.seq_len // lay.cp >= 2048)
    span = lay.tp * lay.cp
    if cluster.num_gpus > cluster.rack_size:
        assert span <= cluster.rack_size and cluster.rack_size % span == 0, "CP stays in a rack"
    if model.is_moe:
        assert model.num_experts % lay.ep == 0 and (lay.dp * lay.cp) % lay.ep == 0
    else:
        assert lay.ep == 1 and p.comm_bytes_per_step["ep"] == 0
    if lay.cp == 1:
        assert p.comm_bytes_per_step["cp"] == 0
    mem = p.memory_per_gpu_bytes
    assert 0 < mem["total"] <= mem["capacity"]
    again = evaluate(model, train, cluster, lay)
    assert again.step_time_s == p.step_time_s and again.comm_bytes_per_step == p.comm_bytes_per_step


def test_pruned_search_finds_the_brute_force_optimum_for_moe():
    model = ModelSpec(
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        vocab=1000,
        seq_len=4096,
        num_experts=8,
        top_k=2,
        expert_ffn=512,
        name="moe-small",
    )
    train, cluster = TrainSpec(16, 4096), ClusterSpec("A100-40GB", 16, 8)
    best, best_t, count = reference_best(model, train, cluster)
    p = plan(model, train, cluster)
    assert best is not None and count > p.candidates_evaluated
    assert p.step_time_s == best_t
    assert math.isfinite(best_t)
