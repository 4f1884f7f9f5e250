"""The closed-form pieces of the cost model, each with its source (docs/planner.md explains them).

Everything here is plain arithmetic on Python numbers so that tests can check the lecture's figures
against it directly; the search (costmodel.py) composes these.
"""

from __future__ import annotations

import math

from training.config.arithmetic import (
    ParamCounts,
    act_bytes,
    block_activation_bytes,
    block_matrices,
    flops_per_token,
    head_activation_bytes,
    param_counts,
    total_params,
)
from training.config.spec import ModelSpec

# The model arithmetic (parameter counts, FLOPs per token) is training.config.arithmetic's, shared
# with the trainer's MFU metric; re-exported here for the planner's importers.
__all__ = [
    "V_SHAPED", "ParamCounts", "activation_bytes_per_layer", "block_matrices", "bubble_fraction",
    "cp_ring_bytes_per_layer", "engine_activation_terms",
    "ep_all_to_all_bytes_per_layer", "flops_per_token", "hops", "inflight_microbatches", "model_state_bytes",
    "param_counts", "recompute_flops_per_token_layer", "ring_bytes", "ring_recompute_flops_per_token_layer",
    "total_params", "tp_bytes_per_layer",
]

# Schedules whose pipeline rank holds both the first and the last stage (V shape).
V_SHAPED = ("zbv_zero_bubble", "dualpipev")


def recompute_flops_per_token_layer(model: ModelSpec, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token per layer that recomputation adds (Korthikanti et al. 2022, Sec. 5)."""
    if recompute == "full":  # one more forward of the whole layer: a third of 6N + 12 h s
        return 2.0 * param_counts(model).matmul_active_per_layer + 4.0 * model.hidden * seq_len
    if recompute == "selective":  # only the attention core (QK^T, softmax, AV) is recomputed
        return 4.0 * model.hidden * seq_len
    return 0.0


def ring_recompute_flops_per_token_layer(model: ModelSpec, seq_len: int) -> float:
    """Extra FLOPs per token per layer of ring attention's backward: each block's scores QK^T are
    recomputed from the saved log-sum-exp (Dao 2023, FlashAttention-2, Sec. 3.1.2), 2*h*s."""
    return 2.0 * model.hidden * seq_len


def cp_ring_bytes_per_layer(kv_local_bytes: float, cp: int, grad_bytes_ratio: float = 2.0) -> float:
    """Bytes one rank sends around the context-parallel ring per layer per micro-batch, fwd + bwd.

    What training/parallel/context.py sends (docs/context_parallel.md, "Costs", measured exactly by
    bench/cp.py): forward, its K/V block travels cp-1 hops; backward, K/V again cp-1 hops and the dK/dV
    accumulator cp hops (a last hop brings it home to its owner), accumulated in fp32. With
    `kv_local_bytes` the K and V of the rank's s/cp tokens in the activation dtype and `grad_bytes_ratio`
    = 4 / activation bytes: (2(cp-1) + cp*r) * kv_local = (4cp-2) * kv_local in bf16, (3cp-2) in fp32.
    Ring attention: Liu et al. 2023.
    """
    if cp <= 1:
        return 0.0
    return (2.0 * (cp - 1) + cp * grad_bytes_ratio) * kv_local_bytes


def ep_all_to_all_bytes_per_layer(tokens: float, top_k: int, h: int, ep: int, act_bytes: int = 2) -> float:
    """Bytes one rank sends in an MoE layer's all-to-alls per micro-batch, forward + backward.

    Each of the rank's `tokens` goes to top_k experts: dispatch sends top_k hidden vectors per token, and
    with balanced routing (ep-1)/ep of them leave the rank; combine sends the expert outputs back, the
    same volume; backward runs both exchanges in reverse with the gradients (Lepikhin et al. 2020,
    GShard, Sec. 3.2; DeepSeek-AI 2024, DeepSeek-V3, Sec. 3.2.2):
    4 * tokens * top_k * h * act_bytes * (ep-1)/ep. Token dropping (capacity factor) only lowers it.
    """
    if ep <= 1:
        return 0.0
    return 4.0 * tokens * top_k * h * act_bytes * (ep - 1) / ep


def model_state_bytes(
    params: float, zero_stage: int, dp: int, bytes_per_param: tuple[int, int, int], fsdp2: bool = False,
    shadow: bool = False, pipelined: bool = False,
) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU for `params` parameters on this GPU before DP sharding.

    Rajbhandari et al. 2020 (ZeRO), Figure 1: stage 1 shards the optimizer state, stage 2 also the
    gradients, stage 3 also the parameters, each over the `dp` data-parallel ranks.

    `fsdp2`: stages 2 and 3 as the engine runs them, with torch FSDP2 (training/parallel/fsdp.py;
    torch.distributed.fsdp.fully_shard and MixedPrecisionPolicy docs): the sharded parameters keep
    their fp32 dtype (under mixed precision they are the master weights, so the optimizer holds only
    the moments), gradients are reduce-scattered into fp32 shards, and stage 2 (reshard_after_forward
    =False) also holds the gathered parameters, in the compute dtype, from forward to backward.
    `shadow`: stage 1 with shadow shards (training.parallel.zero): a second shard of the optimizer
    state, its DP successor's. `pipelined`: stages 2 and 3 under pipeline parallelism, where
    torch.distributed.pipelining drives FSDP2 itself (stage.py, backward_maybe_with_nosync and
    perform_reduce_grad): every backward runs without resharding and without gradient sync, so the
    stage's parameters stay gathered and its gradients accumulate unsharded in the reduce dtype
    (fp32) until one reduce-scatter after the last micro-batch. Measured per rank by
    training.parallel.memory (tests/training/test_memory_accounting.py).
    """
    bp, bg, bo = bytes_per_param
    if fsdp2 and zero_stage >= 2 and dp > 1:
        master = 4 if bp < 4 else 0  # the fp32 master inside `bo` is the sharded parameter itself
        gathered = bp * params if zero_stage == 2 or pipelined else 0.0
        grads = 4 * params if pipelined else 4 * params / dp
        return gathered + 4 * params / dp, grads, (bo - master) * params / dp
    p = bp * params / (dp if zero_stage >= 3 else 1)
    g = bg * params / (dp if zero_stage >= 2 else 1)
    o = bo * params / (dp if zero_stage >= 1 else 1)
    if shadow and zero_stage == 1 and dp > 1:
        o *= 2
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
    ring_attention: bool = False,
) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch.

    Korthikanti et al. 2022, Table 2 (16-bit activations): s*b*h*(34 + 5*a*s/h) without parallelism,
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallel, s*b*h/t*(34 + 5*a*s/h) with sequence
    parallel too; selective recomputation drops the 5*a*s/h attention term; full recomputation keeps
    only the layer input, 2*s*b*h (divided by t with sequence parallel). With context parallel, `s` is
    a rank's share of the sequence and `s_kv` the full length its queries attend to (scores are s x s_kv).
    `ring_attention` (context parallel, training/parallel/context.py): the ring never materialises the
    scores; it keeps q, k, v and the output (inside the 34) and one fp32 log-sum-exp per query and head,
    4*a bytes per token, instead of the 5*a*s/h term (docs/context_parallel.md, "Costs").
    """
    sbh = float(s) * b * h
    if ring_attention:
        attn = 4.0 * a / h
    else:
        attn = 0.0 if recompute == "selective" else 5.0 * a * (s if s_kv is None else s_kv) / h
    if recompute == "full":
        return 2.0 * sbh / (t if sp else 1)
    if sp:
        return sbh / t * (34.0 + attn)
    if t > 1:
        return sbh * (10.0 + 24.0 / t + attn / t)
    return sbh * (34.0 + attn)


def engine_activation_terms(
    model: ModelSpec, tokens: float, tp: int, sp: bool, recompute: str, precision: str
) -> tuple[float, float, float, float]:
    """(per layer, recompute working set, first stage's extra, last stage's extra) activation bytes of
    one micro-batch of a dense model as the engine saves them (training.config.arithmetic, counted from
    training.model.transformer and measured by training.parallel.memory): full recomputation re-runs
    one block with everything saved during its backward; the first stage keeps the int64 tokens; the
    last the final norm, the fp32 log-softmax and the targets."""
    elem = act_bytes(precision)
    layer = block_activation_bytes(model, tokens, tp, sp, recompute, elem)
    work = block_activation_bytes(model, tokens, tp, sp, "none", elem) if recompute == "full" else 0.0
    return layer, work, 8.0 * tokens, head_activation_bytes(model, tokens, tp, sp, elem)


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
