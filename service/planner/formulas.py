"""The closed-form pieces of the cost model, each with its source (docs/planner.md explains them).

Everything here is plain arithmetic on Python numbers so that tests can check the lecture's figures
against it directly; the search (costmodel.py) composes these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.spec import ModelSpec

# Schedules whose pipeline rank holds both the first and the last stage (V shape).
V_SHAPED = ("zbv_zero_bubble", "dualpipev")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one model, split by where they live and how they are sharded."""

    attn: int  # per layer: q, k, v, o projections
    mlp: int  # per layer: dense MLP (0 for MoE)
    experts: int  # per layer: all experts together (0 for dense)
    expert_active: int  # per layer: the top_k experts a token passes through
    router: int  # per layer
    norms: int  # per layer
    embed: int  # input embedding
    head: int  # output projection (0 when tied)
    final_norm: int

    @property
    def per_layer(self) -> int:
        return self.attn + self.mlp + self.experts + self.router + self.norms

    @property
    def per_layer_dense(self) -> int:
        """Per-layer parameters sharded by TP only (everything but the experts)."""
        return self.attn + self.mlp + self.router + self.norms

    @property
    def matmul_active_per_layer(self) -> int:
        """Per-layer weights a token multiplies with (Kaplan et al. 2020: C = 6N per token)."""
        return self.attn + self.mlp + self.expert_active + self.router


def param_counts(model: ModelSpec) -> ParamCounts:
    h, f = model.hidden, model.ffn_dim
    kv_dim = model.n_kv_heads * model.head_dim
    attn = 2 * h * h + 2 * h * kv_dim  # q and o are h x h; k and v are h x kv_dim (GQA)
    mats = 3 if model.activation == "swiglu" else 2  # SwiGLU has gate, up, down; GeLU MLP has up, down
    if model.is_moe:
        one_expert = mats * h * model.expert_ffn_dim
        mlp, experts, active, router = (
            0,
            model.num_experts * one_expert,
            model.top_k * one_expert,
            h * model.num_experts,
        )
    else:
        mlp, experts, active, router = mats * h * f, 0, 0, 0
    embed = model.vocab * h
    head = 0 if model.tied_embeddings else model.vocab * h
    return ParamCounts(attn, mlp, experts, active, router, 2 * h, embed, head, h)


def total_params(model: ModelSpec) -> int:
    c = param_counts(model)
    return model.layers * c.per_layer + c.embed + c.head + c.final_norm


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), without recomputation.

    6 FLOPs per weight a token touches (Kaplan et al. 2020) plus attention scores and values,
    12 * layers * hidden * seq_len (Chowdhery et al. 2022, PaLM, Appendix B; no causal discount).
    The input embedding is a lookup (no FLOPs); the output projection is a matmul (6 * vocab * hidden).
    """
    c = param_counts(model)
    per_layer = 6.0 * c.matmul_active_per_layer + 12.0 * model.hidden * seq_len
    return model.layers * per_layer + 6.0 * model.vocab * model.hidden


def recompute_flops_per_token_layer(model: ModelSpec, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token per layer that recomputation adds (Korthikanti et al. 2022, Sec. 5)."""
    if recompute == "full":  # one more forward of the whole layer: a third of 6N + 12 h s
        return 2.0 * param_counts(model).matmul_active_per_layer + 4.0 * model.hidden * seq_len
    if recompute == "selective":  # only the attention core (QK^T, softmax, AV) is recomputed
        return 4.0 * model.hidden * seq_len
    return 0.0


def model_state_bytes(
    params: float, zero_stage: int, dp: int, bytes_per_param: tuple[int, int, int]
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for `params` parameters on this GPU before DP sharding.

    Rajbhandari et al. 2020 (ZeRO), Figure 1: stage 1 shards the optimizer state, stage 2 also the
    gradients, stage 3 also the parameters, each over the `dp` data-parallel ranks.
    """
    bp, bg, bo = bytes_per_param
    p = bp * params / (dp if zero_stage >= 3 else 1)
    g = bg * params / (dp if zero_stage >= 2 else 1)
    o = bo * params / (dp if zero_stage >= 1 else 1)
    return p, g, o


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    s_kv: int | None = None,
) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch.

    Korthikanti et al. 2022, Table 2 (16-bit activations): s*b*h*(34 + 5*a*s/h) without parallelism,
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallel, s*b*h/t*(34 + 5*a*s/h) with sequence
    parallel too; selective recomputation drops the 5*a*s/h attention term; full recomputation keeps
    only the layer input, 2*s*b*h (divided by t with sequence parallel). With context parallel, `s` is
    a rank's share of the sequence and `s_kv` the full length its queries attend to (scores are s x s_kv).
    """
    sbh = float(s) * b * h
    attn = 0.0 if recompute == "selective" else 5.0 * a * (s if s_kv is None else s_kv) / h
    if recompute == "full":
        return 2.0 * sbh / (t if sp else 1)
    if sp:
        return sbh / t * (34.0 + attn)
    if t > 1:
        return sbh * (10.0 + 24.0 / t + attn / t)
    return sbh * (34.0 + attn)


def tp_bytes_per_layer(b: int, s: int, h: int, t: int) -> float:
    """Bytes each GPU sends per layer per micro-batch in one pass (forward or backward) for TP.

    Two all-reduces of the b*s*h bf16 activation per block, ring cost 2*(t-1)/t each:
    8*b*s*h*(t-1)/t (Shoeybi et al. 2019; lecture 55:31). With sequence parallel the all-reduces
    become all-gather + reduce-scatter pairs of the same total volume (Korthikanti et al. 2022, Sec. 4.2.2).
    """
    return 8.0 * b * s * h * (t - 1) / t


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline, relative to the ideal (busy) time.

    (p-1)/m for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021), (p-1)/(v*m) with v
    interleaved stages per rank (Narayanan et al. 2021, Sec. 2.2.2); the zero-bubble schedules move
    weight-gradient work into the bubble, which leaves about a third of it (Qi et al. 2023, ZB-H1).
    """
    if p <= 1 or schedule == "none":
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m)
    # interleaved_zero_bubble, zbv_zero_bubble, dualpipev
    return (p - 1) / (3.0 * v * m)


def inflight_microbatches(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Micro-batches whose activations the first pipeline rank holds at its peak, in units of its layers.

    GPipe runs every forward first (m); 1F1B holds at most p (Narayanan et al. 2021, Sec. 2.2.1);
    interleaving holds p*(1 + (p-1)/(p*v)) (Korthikanti et al. 2022, Sec. 4.2.3); ZB-V matches 1F1B
    (Qi et al. 2024); DualPipeV holds p+1 (DeepSeek-AI 2024, Table 2). Never more than m (times v
    stages for the interleaved schedules).
    """
    if p <= 1 or schedule == "none":
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zbv_zero_bubble"):
        return float(min(p, m))
    if schedule == "dualpipev":
        return float(min(p + 1, m))
    # interleaved_1f1b, interleaved_zero_bubble
    return min(p + (p - 1) / v, float(m))


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective over n ranks (Thakur et al. 2005; lecture 05:03)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * nbytes * (n - 1) / n
    return nbytes * (n - 1) / n  # reduce_scatter, all_gather


def hops(n: int) -> int:
    """Latency steps of a tree / recursive-halving collective over n ranks (alpha term)."""
    return 0 if n <= 1 else math.ceil(math.log2(n))
