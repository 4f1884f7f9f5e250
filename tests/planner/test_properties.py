"""Properties of every plan the search returns (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.planner import (
    GPU_CATALOG,
    ClusterSpec,
    ModelSpec,
    PlannerError,
    TrainSpec,
    evaluate,
    get_preset,
    plan,
)
from service.planner.candidates import INTERLEAVE_DEPTHS
from service.planner.reference import reference_best
from training.config.validate import check_layout_for_model

REAL_GPUS = [name for name in GPU_CATALOG if name != "cpu-virtual"]


@st.composite
def problems(draw: st.DrawFn) -> tuple[ModelSpec, TrainSpec, ClusterSpec, tuple[int, ...]]:
    heads = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32, 64, 96]))
    kv_heads = draw(st.sampled_from([k for k in (1, 2, 4, 8, 16, 32) if heads % k == 0]))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    seq_len = draw(st.sampled_from([128, 512, 2048, 4096, 8192]))
    model = ModelSpec(
        layers=draw(st.integers(1, 96)),
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv_heads,
        vocab=128 * draw(st.integers(1, 1000)),  # padded, as real vocabularies are
        seq_len=seq_len,
        activation=draw(st.sampled_from(["swiglu", "gelu"])),
        tied_embeddings=draw(st.booleans()),
    )
    gpu = draw(st.sampled_from(REAL_GPUS))
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    cluster = ClusterSpec(
        gpu,
        gpn * nodes,
        gpn,
        nodes_per_rack=draw(st.sampled_from([1, 2, 4])),
        oversubscription=draw(st.sampled_from([1.0, 2.0])),
    )
    batch = draw(st.integers(1, 64)) * draw(st.sampled_from([1, 8, 16]))
    train = TrainSpec(batch, seq_len, draw(st.sampled_from(["bf16_fp32_adam", "bf16_fp32_master"])))
    zero = draw(st.sampled_from([(0, 1, 2, 3), (0, 1), (1,), (3,), (2, 3)]))
    return model, train, cluster, zero


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_plan_satisfies_every_constraint(
    problem: tuple[ModelSpec, TrainSpec, ClusterSpec, tuple[int, ...]],
):
    model, train, cluster, zero = problem
    try:
        p = plan(model, train, cluster, zero_stages=zero, top_k=3)
    except PlannerError as e:
        assert "fits no layout" in str(e)
        return
    lay = p.layout
    gpn = cluster.gpn
    assert lay.world_size == cluster.num_gpus
    assert lay.global_batch == train.global_batch
    assert lay.tp <= gpn and gpn % lay.tp == 0, "TP never leaves the node"
    assert model.heads % lay.tp == 0 and model.n_kv_heads % lay.tp == 0
    assert train.seq_len % lay.cp == 0
    assert lay.pp * lay.virtual_stages <= model.layers
    assert lay.zero_stage in zero
    assert lay.dp <= train.global_batch
    if lay.pp > 1 and lay.schedule != "gpipe":
        assert lay.num_microbatches >= lay.pp
    if lay.virtual_stages > 1:
        assert lay.virtual_stages in INTERLEAVE_DEPTHS and lay.num_microbatches % lay.pp == 0
    assert lay.sequence_parallel == (lay.tp > 1), "sequence parallel is on whenever TP > 1"
    check_layout_for_model(model, lay)  # the engine runs every plan the search returns
    mem = p.memory_per_gpu_bytes
    assert 0 < mem["total"] <= mem["capacity"], "memory never exceeds capacity"
    parts = ("params", "grads", "optimizer", "activations", "loss_backward", "buffers", "reserve")
    assert abs(sum(mem[k] for k in parts) - mem["total"]) <= 1e-9 * mem["total"]
    assert 0 < p.mfu < 1
    for alt in p.alternatives:
        assert alt["step_time_s"] >= p.step_time_s
        assert alt["memory_total_bytes"] <= mem["capacity"]
    # evaluate(best layout) is the search's own prediction, exactly
    again = evaluate(model, train, cluster, lay)
    assert again.step_time_s == p.step_time_s
    assert again.memory_per_gpu_bytes == p.memory_per_gpu_bytes
    assert again.comm_bytes_per_step == p.comm_bytes_per_step
    assert again.bubble_fraction == p.bubble_fraction


@pytest.mark.parametrize(
    "preset,batch,gpu,gpus,per_node",
    [
        ("demo", 8, "cpu-virtual", 8, 4),
        ("tiny", 16, "cpu-virtual", 8, 4),
        ("gpt2-small", 64, "A100-40GB", 16, 8),
        ("llama3-8b", 32, "H100-80GB", 16, 8),
    ],
)
def test_pruned_search_finds_the_brute_force_optimum(
    preset: str, batch: int, gpu: str, gpus: int, per_node: int
):
    model = get_preset(preset)
    train, cluster = TrainSpec(batch, model.seq_len), ClusterSpec(gpu, gpus, per_node)
    best, best_t, count = reference_best(model, train, cluster)
    p = plan(model, train, cluster)
    assert best is not None and count > p.candidates_evaluated
    assert p.step_time_s == best_t


@pytest.mark.parametrize(
    "preset,batch,gpu,gpus",
    [
        ("mixtral-8x7b", 256, "H100-80GB", 64),
        ("deepseek-v3", 2048, "H100-80GB", 2048),
        ("gpt2-small", 64, "A100-40GB", 16),
        ("gpt3-175b", 1536, "A100-80GB", 1024),
        ("demo", 8, "cpu-virtual", 8),
    ],
)
def test_plans_are_layouts_the_engine_runs(preset: str, batch: int, gpu: str, gpus: int):
    model = get_preset(preset)
    cluster = ClusterSpec(gpu, gpus, 4 if gpu == "cpu-virtual" else 8)
    p = plan(model, TrainSpec(batch, model.seq_len), cluster)
    check_layout_for_model(model, p.layout)
    if model.is_moe:
        assert p.layout.tp == 1 and p.layout.zero_stage <= 1
