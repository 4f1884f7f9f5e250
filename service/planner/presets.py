"""Model shape presets (training.config.spec.ModelSpec), with the source of each shape."""

from __future__ import annotations

from service.planner.errors import PlannerError
from training.config.spec import ModelSpec

PRESETS: dict[str, ModelSpec] = {
    # CPU smoke model: trains in seconds; heads and layers divisible by 2 and 4 so TP2/PP2 work.
    "tiny": ModelSpec(layers=4, hidden=64, heads=4, vocab=256, seq_len=32, name="tiny"),
    # The embedded demo: GQA with 2 KV heads (so TP <= 2), 4 layers (so PP in 1, 2, 4). On 8 cpu-virtual
    # GPUs (4 per node) with global batch 8 the planner picks tp=2, pp=2, dp=2 (docs/planner.md).
    "demo": ModelSpec(layers=4, hidden=128, heads=8, kv_heads=2, vocab=512, seq_len=64, name="demo"),
    # Radford et al. 2019 (GPT-2), 124M and 350M: learned positions aside, same matmul shapes.
    "gpt2-small": ModelSpec(
        layers=12,
        hidden=768,
        heads=12,
        vocab=50304,  # 50257 padded to a multiple of 128 (nanoGPT, Megatron): TP splits it evenly
        seq_len=1024,
        activation="gelu",
        tied_embeddings=True,
        name="gpt2-small",
    ),
    "gpt2-medium": ModelSpec(
        layers=24,
        hidden=1024,
        heads=16,
        vocab=50304,  # 50257 padded to a multiple of 128 (nanoGPT, Megatron): TP splits it evenly
        seq_len=1024,
        activation="gelu",
        tied_embeddings=True,
        name="gpt2-medium",
    ),
    # Llama 3 Herd of Models (Meta 2024), Table 3.
    "llama3-8b": ModelSpec(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn=14336,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
        name="llama3-8b",
    ),
    "llama3-70b": ModelSpec(
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        ffn=28672,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
        name="llama3-70b",
    ),
    "llama3-405b": ModelSpec(
        layers=126,
        hidden=16384,
        heads=128,
        kv_heads=8,
        ffn=53248,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
        name="llama3-405b",
    ),
    # Brown et al. 2020 (GPT-3), Table 2.1: 96 layers, d_model 12288, 96 heads, 2048 context.
    "gpt3-175b": ModelSpec(
        layers=96,
        hidden=12288,
        heads=96,
        vocab=50304,  # 50257 padded to a multiple of 128 (nanoGPT, Megatron): TP splits it evenly
        seq_len=2048,
        activation="gelu",
        name="gpt3-175b",
    ),
    # CS336 assignment 2, communication_accounting: d_model 16384, d_ff 53248, 126 blocks. The course
    # problem counts only the two FFN matmuls; this preset is the full transformer of that shape.
    "xxl": ModelSpec(
        layers=126,
        hidden=16384,
        heads=128,
        ffn=53248,
        vocab=50304,  # 50257 padded to a multiple of 128 (nanoGPT, Megatron): TP splits it evenly
        seq_len=2048,
        activation="gelu",
        name="xxl",
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 32 layers, 4096 wide, 8 experts, top-2, expert ffn 14336.
    "mixtral-8x7b": ModelSpec(
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        vocab=32000,
        seq_len=4096,
        num_experts=8,
        top_k=2,
        expert_ffn=14336,
        ffn=14336,
        rope_theta=1e6,
        name="mixtral-8x7b",
    ),
    # DeepSeek-V3 (DeepSeek-AI 2024, Sec. 4.2): 61 layers, hidden 7168, 128 heads, 256 routed experts
    # with top-8 routing, expert ffn 2048, vocabulary 129280, 4096-token pre-training sequences.
    # Approximations (ModelSpec has no such fields): multi-head latent attention is modelled as
    # standard multi-head attention (4 h^2 per layer instead of MLA's ~187M, +10%), and the shared
    # expert and the 3 leading dense layers are left out. Total 702B vs the published 671B (+4.6%),
    # active 35B vs 37B (-5%) (tests/planner/test_cp_ep.py checks both).
    "deepseek-v3": ModelSpec(
        layers=61,
        hidden=7168,
        heads=128,
        vocab=129280,
        seq_len=4096,
        num_experts=256,
        top_k=8,
        expert_ffn=2048,
        ffn=18432,
        name="deepseek-v3",
    ),
}


def get_preset(name: str) -> ModelSpec:
    """The preset's ModelSpec; PlannerError lists the known names."""
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise PlannerError(f"model.preset must be one of {', '.join(PRESETS)}, got {name!r}") from None
