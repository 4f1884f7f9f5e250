"""One model arithmetic: the planner's and the trainer's parameter counts and FLOPs per token are the
same numbers (training.config.arithmetic), and the parameter count is what the engine builds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import service.planner as planner
from training.config.arithmetic import flops_per_token, model_flops_per_token, param_counts, total_params
from training.config.hardware import GPU_CATALOG, peak_flops_of_device
from training.config.spec import ModelSpec
from training.model.transformer import build_model
from training.parallel.dist import peak_flops

DENSE_TIED = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32, tied_embeddings=True)
DENSE_UNTIED = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seq_len=32)
MOE = ModelSpec(layers=4, hidden=32, heads=4, vocab=128, seq_len=16, ffn=128, num_experts=4, top_k=2,
                expert_ffn=32, moe_layer_freq=2)
MOE_GELU_TIED = ModelSpec(layers=3, hidden=32, heads=4, kv_heads=2, vocab=100, seq_len=16, num_experts=4,
                          top_k=1, moe_layer_freq=3, activation="gelu", tied_embeddings=True)
MODELS = [DENSE_TIED, DENSE_UNTIED, MOE, MOE_GELU_TIED]
IDS = ["dense-tied", "dense-untied", "moe", "moe-gelu-tied"]


@pytest.mark.parametrize("spec", MODELS, ids=IDS)
def test_param_count_is_the_built_models_numel(spec: ModelSpec) -> None:
    model = build_model(spec, seed=0)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert planner.total_params(spec) == total_params(spec)


@pytest.mark.parametrize("spec", MODELS, ids=IDS)
def test_planner_and_trainer_agree_on_flops(spec: ModelSpec) -> None:
    assert model_flops_per_token(spec) == planner.flops_per_token(spec, spec.seq_len)
    assert planner.flops_per_token is flops_per_token and planner.param_counts is param_counts


def test_flops_are_6n_over_the_matmul_weights_plus_attention() -> None:
    # 6 per matmul weight a token touches (Kaplan et al. 2020) + 12 L h s (PaLM, App. B).
    h, s, v, layers = DENSE_TIED.hidden, DENSE_TIED.seq_len, DENSE_TIED.vocab, DENSE_TIED.layers
    attn, mlp = 4 * h * h, 3 * h * DENSE_TIED.ffn_dim
    # Tied: the head is the embedding's weight, but still a matmul of vocab x hidden per token.
    assert flops_per_token(DENSE_TIED, s) == 6 * (layers * (attn + mlp) + v * h) + 12 * layers * h * s
    untied = ModelSpec(**{**DENSE_TIED.to_dict(), "tied_embeddings": False})
    assert flops_per_token(untied, s) == flops_per_token(DENSE_TIED, s)
    assert total_params(untied) - total_params(DENSE_TIED) == v * h


def test_one_peak_flops_table_for_the_planner_and_the_mfu_metric() -> None:
    assert planner.GPU_CATALOG is GPU_CATALOG
    assert peak_flops_of_device("NVIDIA H100 80GB HBM3") == GPU_CATALOG["H100-80GB"].peak_flops
    assert peak_flops_of_device("NVIDIA H200") == GPU_CATALOG["H200-141GB"].peak_flops
    assert peak_flops_of_device("NVIDIA A100-SXM4-40GB") == GPU_CATALOG["A100-40GB"].peak_flops
    assert peak_flops_of_device("NVIDIA B200") == GPU_CATALOG["B200"].peak_flops
    assert peak_flops_of_device("NVIDIA L40S") == 362e12
    assert peak_flops_of_device("Tesla T4") is None
    assert peak_flops(torch.device("cpu")) is None


def test_config_is_torch_free() -> None:
    code = (
        "import sys, training.config.arithmetic, training.config.hardware, training.config.layout, "
        "training.config.run, training.config.spec, training.config.validate; "
        "assert 'torch' not in sys.modules, 'training.config imports torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
