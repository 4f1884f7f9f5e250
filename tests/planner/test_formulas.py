"""The lecture's figures come out of the planner's code."""

from __future__ import annotations

import math

import pytest

from service.planner import (
    ClusterSpec,
    Layout,
    TrainSpec,
    activation_bytes_per_layer,
    bubble_fraction,
    evaluate,
    flops_per_token,
    get_preset,
    model_state_bytes,
    param_counts,
    total_params,
    tp_bytes_per_layer,
)
from training.config.spec import ModelSpec


def test_mixed_precision_adam_is_16_bytes_per_param_and_master_only_is_12():
    # lecture 14:09: 2 (bf16 params) + 2 (bf16 grads) + 4 (fp32 master) + 4 + 4 (Adam moments)
    assert sum(TrainSpec(1, 1).bytes_per_param) == 16
    assert sum(TrainSpec(1, 1, precision="bf16_fp32_master").bytes_per_param) == 12


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_model_on_64_gpus(stage: int, expected_gb: float):
    # Rajbhandari et al. 2020, Figure 1 (lecture 18:47): 120 -> 31.4 -> 16.6 -> 1.9 GB per device
    got = sum(model_state_bytes(7.5e9, stage, 64, TrainSpec(1, 1).bytes_per_param)) / 1e9
    assert got == pytest.approx(expected_gb, rel=0.02)


def test_planner_memory_breakdown_uses_the_zero_formula():
    model = ModelSpec(layers=4, hidden=512, heads=8, vocab=1000, seq_len=128)
    train = TrainSpec(global_batch=8, seq_len=128)
    cluster = ClusterSpec("H100-80GB", 8)
    for stage in (0, 1, 2, 3):
        p = evaluate(model, train, cluster, Layout(dp=8, zero_stage=stage))
        want = model_state_bytes(total_params(model), stage, 8, train.bytes_per_param, fsdp2=True)
        got = (
            p.memory_per_gpu_bytes["params"],
            p.memory_per_gpu_bytes["grads"],
            p.memory_per_gpu_bytes["optimizer"],
        )
        assert got == pytest.approx(want, rel=1e-12)


# GPT-3 175B shape, the case Korthikanti et al. 2022 work through: s=2048, h=12288, a=96, t=8.
S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H


@pytest.mark.parametrize(
    "t,sp,recompute,expected",
    [
        (1, False, "none", SBH * (34 + 5 * A * S / H)),  # no parallelism
        (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),  # tensor parallel
        (T, True, "none", SBH / T * (34 + 5 * A * S / H)),  # tensor + sequence parallel
        (T, False, "selective", SBH * (10 + 24 / T)),  # tensor parallel + selective recompute
        (T, True, "selective", SBH * 34 / T),  # the cheat-sheet figure, lecture 63:21
        (1, False, "full", 2 * SBH),  # full recomputation keeps only the layer input
        (T, True, "full", 2 * SBH / T),
    ],
)
def test_activation_formula_cases(t: int, sp: bool, recompute: str, expected: float):
    assert activation_bytes_per_layer(S, B, H, A, t, sp, recompute) == pytest.approx(expected, rel=1e-12)


def test_planner_activation_memory_is_layers_times_the_formula_plus_embedding_and_logits():
    # Korthikanti et al.'s GPT (unfused attention, the published runs' era).
    m = get_preset("gpt2-small")
    p = evaluate(m, TrainSpec(1, m.seq_len, attention="unfused"), ClusterSpec("H100-80GB", 1), Layout())
    s, h = m.seq_len, m.hidden
    per_layer = s * h * (34 + 5 * m.heads * s / h)
    expected = m.layers * per_layer + 2 * s * h + 6 * s * m.vocab  # + bf16 embedding out + logits/loss buffer
    assert p.memory_per_gpu_bytes["activations"] == pytest.approx(expected, rel=1e-12)


def test_planner_activation_memory_of_the_engine_is_its_saved_tensors():
    # Flash attention (the engine): what training.model.transformer saves (training.config.arithmetic),
    # held to the engine's measurement by tests/training/test_memory_accounting.py.
    from training.config.arithmetic import block_activation_bytes, head_activation_bytes

    m = get_preset("gpt2-small")
    p = evaluate(m, TrainSpec(1, m.seq_len), ClusterSpec("H100-80GB", 1), Layout())
    t = m.seq_len
    expected = m.layers * block_activation_bytes(m, t) + 8 * t + head_activation_bytes(m, t)  # + tokens
    assert p.memory_per_gpu_bytes["activations"] == pytest.approx(expected, rel=1e-12)


def test_bubble_fraction():
    assert bubble_fraction("1f1b", 4, 16) == pytest.approx(3 / 16)
    assert bubble_fraction("gpipe", 8, 32) == pytest.approx(7 / 32)
    assert bubble_fraction("interleaved_1f1b", 4, 16, v=2) == pytest.approx(3 / 32)
    assert bubble_fraction("none", 1, 16) == 0.0


def test_planner_step_time_carries_the_bubble():
    m = get_preset("llama3-8b")
    lay = Layout(tp=8, pp=4, dp=2, zero_stage=1, num_microbatches=16, schedule="1f1b", sequence_parallel=True)
    p = evaluate(m, TrainSpec(32, 4096), ClusterSpec("H100-80GB", 64), lay)
    assert p.bubble_fraction == pytest.approx(3 / 16)
    t = p.time_breakdown_s
    busy = sum(v for k, v in t.items() if k not in ("bubble", "dp_exposed", "optimizer"))
    assert t["bubble"] == pytest.approx(3 / 16 * busy, rel=1e-9)
    assert sum(t.values()) == pytest.approx(p.step_time_s, rel=1e-12)


def test_tp_traffic_formula():
    assert tp_bytes_per_layer(2, 1024, 4096, 8) == pytest.approx(8 * 2 * 1024 * 4096 * 7 / 8)
    m = get_preset("llama3-70b")
    lay = Layout(
        tp=8,
        pp=2,
        dp=4,
        zero_stage=1,
        num_microbatches=16,
        schedule="1f1b",
        sequence_parallel=True,
        recompute="selective",
    )
    p = evaluate(m, TrainSpec(64, 2048), ClusterSpec("H100-80GB", 64), lay)
    layers_per_rank = m.layers // 2
    forward_and_backward = 2
    want = forward_and_backward * 16 * layers_per_rank * 8 * 1 * 2048 * m.hidden * (8 - 1) / 8
    assert p.comm_bytes_per_step["tp"] == pytest.approx(want, rel=1e-12)


def test_xxl_course_problem_memory():
    # CS336 A2 communication_accounting: FFN-only XXL (d_model 16384, d_ff 53248, 126 blocks), fp32 master
    # weights, accumulated gradients and Adam state = 16 bytes/param.
    xxl = get_preset("xxl")
    assert (xxl.hidden, xxl.ffn_dim, xxl.layers) == (16384, 53248, 126)
    ffn_params = xxl.layers * param_counts(xxl).mlp
    assert ffn_params == 126 * 2 * 16384 * 53248
    state = sum(model_state_bytes(ffn_params, 0, 1, (4, 4, 8)))
    assert state / 1e12 == pytest.approx(3.52, abs=0.005)
    assert math.ceil(state / 80e9) == 44  # H100-80GB worth of memory
    assert math.ceil(state / 95e9) == 38  # FSDP degree to get under one TPU v5p (95 GB)
    assert (
        sum(model_state_bytes(ffn_params, 3, 38, (4, 4, 8)))
        < 95e9
        < sum(model_state_bytes(ffn_params, 3, 37, (4, 4, 8)))
    )


@pytest.mark.parametrize(
    "name,billions",
    [
        ("gpt2-small", 0.124),
        ("gpt2-medium", 0.355),
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.6),
        ("llama3-405b", 405.9),
        ("gpt3-175b", 175.0),
    ],
)
def test_preset_parameter_counts(name: str, billions: float):
    assert total_params(get_preset(name)) / 1e9 == pytest.approx(billions, rel=0.015)


def test_flops_per_token_is_6n_plus_attention():
    m = get_preset("gpt2-small")
    c = param_counts(m)
    n_matmul = m.layers * (c.attn + c.mlp) + m.vocab * m.hidden
    assert flops_per_token(m, 1024) == pytest.approx(6 * n_matmul + 12 * m.layers * m.hidden * 1024)
    p = evaluate(m, TrainSpec(8, 1024), ClusterSpec("H100-80GB", 8), Layout(dp=8))
    assert p.flops_per_step == pytest.approx(flops_per_token(m, 1024) * 8 * 1024)
    assert p.mfu == pytest.approx(p.flops_per_step / (p.step_time_s * 989e12 * 8))
