"""Model arithmetic: parameter counts and training FLOPs per token of the model the engine builds.

The one definition used by the planner (service.planner.formulas re-exports it), the trainer's MFU
metric and the tests. Pure Python on a ModelSpec (no torch). Counts match what
training.model.transformer builds: no biases, RMSNorm weights only, the head shares the embedding
when `tied_embeddings`, MoE blocks hold every expert plus a router.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config.spec import ModelSpec


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one model, split by where they live and how they are sharded.

    Per-layer figures are averages over the layers: with ModelSpec.moe_layer_freq > 1 only every
    k-th block is MoE, so `mlp`, `experts`, `expert_active` and `router` are the dense MLP and the
    MoE parts weighted by their share of the blocks (then layers x per-layer figure is exact).
    """

    attn: float  # per layer: q, k, v, o projections
    mlp: float  # per layer: dense MLP (0 for an all-MoE model)
    experts: float  # per layer: all experts together (0 for dense)
    expert_active: float  # per layer: the top_k experts a token passes through
    router: float  # per layer
    norms: float  # per layer
    embed: int  # input embedding
    head: int  # output projection (0 when tied)
    final_norm: int
    moe_fraction: float = 0.0  # share of the blocks that are MoE

    @property
    def per_layer(self) -> float:
        return self.attn + self.mlp + self.experts + self.router + self.norms

    @property
    def per_layer_dense(self) -> float:
        """Per-layer parameters sharded by TP only (everything but the experts)."""
        return self.attn + self.mlp + self.router + self.norms

    @property
    def matmul_active_per_layer(self) -> float:
        """Per-layer weights a token multiplies with (Kaplan et al. 2020: C = 6N per token; for MoE only
        the top_k experts it is routed to, Fedus et al. 2022, Switch Transformer, Sec. 2)."""
        return self.attn + self.mlp + self.expert_active + self.router


def _mlp_matrices(model: ModelSpec) -> int:
    return 3 if model.activation == "swiglu" else 2  # SwiGLU has gate, up, down; GeLU MLP has up, down


def block_matrices(model: ModelSpec) -> int:
    """Weight matrices of one block: q, k, v, o and the MLP's (the linears TP shards, the tensors the
    optimizer steps besides the two norms)."""
    return 4 + _mlp_matrices(model)


def param_counts(model: ModelSpec) -> ParamCounts:
    h, f = model.hidden, model.ffn_dim
    kv_dim = model.n_kv_heads * model.head_dim
    attn = 2 * h * h + 2 * h * kv_dim  # q and o are h x h; k and v are h x kv_dim (GQA)
    mats = _mlp_matrices(model)
    frac = model.num_moe_layers / model.layers if model.is_moe else 0.0
    one_expert = mats * h * model.expert_ffn_dim
    mlp = (1.0 - frac) * mats * h * f
    experts = frac * model.num_experts * one_expert
    active = frac * model.top_k * one_expert
    router = frac * h * model.num_experts
    embed = model.vocab * h
    head = 0 if model.tied_embeddings else model.vocab * h
    return ParamCounts(attn, mlp, experts, active, router, 2 * h, embed, head, h, frac)


def total_params(model: ModelSpec) -> int:
    """Every parameter of the full model (all experts), exactly `sum(p.numel())` of the built model."""
    h = model.hidden
    kv_dim = model.n_kv_heads * model.head_dim
    mats = _mlp_matrices(model)
    n_moe = model.num_moe_layers if model.is_moe else 0
    attn_and_norms = 2 * h * h + 2 * h * kv_dim + 2 * h
    dense_mlp = mats * h * model.ffn_dim
    moe_mlp = model.num_experts * mats * h * model.expert_ffn_dim + h * model.num_experts  # experts + router
    embed = model.vocab * h
    head = 0 if model.tied_embeddings else model.vocab * h
    blocks = model.layers * attn_and_norms + (model.layers - n_moe) * dense_mlp + n_moe * moe_mlp
    return blocks + embed + head + h  # + the final norm


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), without recomputation.

    6 FLOPs per weight a token touches (Kaplan et al. 2020) plus attention scores and values,
    12 * layers * hidden * seq_len (Chowdhery et al. 2022, PaLM, Appendix B; no causal discount).
    The input embedding is a lookup (no FLOPs); the output projection is a matmul (6 * vocab * hidden),
    tied to the embedding or not; norms are not matmuls and are left out.
    """
    c = param_counts(model)
    per_layer = 6.0 * c.matmul_active_per_layer + 12.0 * model.hidden * seq_len
    return model.layers * per_layer + 6.0 * model.vocab * model.hidden


def model_flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token at the model's own sequence length."""
    return flops_per_token(model, model.seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, world_size: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation (Chowdhery et al. 2022, PaLM, Appendix B): achieved model FLOP/s over
    the peak of every rank's device; None when the peak is unknown."""
    return tokens_per_s * flops_per_token / (world_size * peak) if peak else None


def act_bytes(precision: str) -> int:
    """Bytes per activation element: 4 in fp32, 2 under the bf16 regimes (training.parallel.precision)."""
    return 4 if precision == "fp32" else 2


def norm_activation_bytes(model: ModelSpec, tokens: float, tp: int = 1, sp: bool = False,
                          elem: int = 2) -> float:
    """Bytes one RMSNorm and the linears after it keep for backward: the fp32 upcast of its input, the
    fp32 1/rms per token and the normalised tensor (all sharded over TP under sequence parallel),
    and the (all-gathered) output the next linears save. Counted from training.model.transformer's
    saved tensors (torch.autograd.graph.saved_tensors_hooks; tests/training/test_memory_accounting.py)."""
    shard = tp if sp else 1
    return tokens * ((4 + elem) * model.hidden + 4) / shard + elem * tokens * model.hidden


def block_activation_bytes(model: ModelSpec, tokens: float, tp: int = 1, sp: bool = False,
                           recompute: str = "none", elem: int = 2) -> float:
    """Bytes one dense block of the engine keeps for backward per micro-batch of `tokens` tokens.

    What training.model.transformer saves, counted tensor by tensor (and measured by
    training.parallel.memory): two norms (norm_activation_bytes); attention's q, k, v and output in
    the activation dtype and one fp32 log-sum-exp per query head (fused SDPA keeps no s x s scores,
    Dao 2023, FlashAttention-2); the MLP's inputs of its nonlinearity and of the down projection
    (SwiGLU: w1 x, w3 x, silu(w1 x) and their product; GeLU: w1 x and gelu(w1 x)). Selective
    recomputation keeps only the attention branch's input, full recomputation only the block's
    (Korthikanti et al. 2022, Sec. 5, for which tensors each keeps). Differs from Korthikanti et al.'s
    Table 2 (34 sbh + 5as/h, GPT-3's LayerNorm, GeLU, dropout and unfused attention).
    """
    shard = tp if sp else 1
    h, elem_t = model.hidden, elem * tokens
    if recompute == "full":
        return elem_t * h / shard
    q_dim, kv_dim = model.heads * model.head_dim, model.n_kv_heads * model.head_dim
    mlp = (4 if model.activation == "swiglu" else 2) * elem_t * model.ffn_dim / tp
    norms = 2 * norm_activation_bytes(model, tokens, tp, sp, elem)
    if recompute == "selective":
        return elem_t * h / shard + norms / 2 + mlp
    core = (elem_t * (2 * q_dim + 2 * kv_dim) + 4.0 * tokens * model.heads) / tp
    return norms + core + mlp


def head_activation_bytes(model: ModelSpec, tokens: float, tp: int = 1, sp: bool = False,
                          elem: int = 2) -> float:
    """The last stage's extra: the final norm, the fp32 log-softmax of the full vocabulary (the loss is
    not vocabulary-parallel) and the int64 targets."""
    return norm_activation_bytes(model, tokens, tp, sp, elem) + 4.0 * tokens * model.vocab + 8.0 * tokens
