"""Predicted step time and memory of one layout, computed in stages the search can hoist.

The search and `evaluate` call exactly these functions in the same order, so a layout's prediction
is the same number whichever way it was reached. Stages, from the outside in:

  Env     (model, train, cluster)               catalog numbers, tiers of the network
  Family  (tp, cp, pp, dp, ep)                  parameters per GPU, group tiers
  Stage   (family, v, V-shape)                  layers per rank, model state and DP cost per ZeRO stage
  Micro   (family, micro-batch, sp, recompute)  per-layer activation bytes and time per micro-batch
  combine (stage, micro, schedule, m)           pipeline: bubble, in-flight activations
  finish  (stage, combo, zero stage)            DP exposure, optimizer step, memory total

Formulas and their sources are in formulas.py and docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.planner.efficiency import Efficiency
from service.planner.formulas import (
    ParamCounts,
    activation_bytes_per_layer,
    block_matrices,
    bubble_fraction,
    cp_ring_bytes_per_layer,
    engine_activation_terms,
    ep_all_to_all_bytes_per_layer,
    flops_per_token,
    hops,
    inflight_microbatches,
    model_state_bytes,
    param_counts,
    recompute_flops_per_token_layer,
    ring_recompute_flops_per_token_layer,
    tp_bytes_per_layer,
)
from service.planner.hardware import GpuType
from service.planner.specs import ClusterSpec, TrainSpec
from service.planner.tiers import Tier, collective, off_node, plus, wider
from training.config.run import shadow_conflicts
from training.config.spec import ModelSpec

# Communication overlapped with compute is not free: collective kernels occupy SMs and HBM bandwidth
# (NCCL runs 16-32 channels, i.e. SMs, of 132 on an H100). Each overlapped second costs this much
# compute time (calibration, docs/planner.md); per device type: GpuType.overlap_slowdown.
OVERLAP_SLOWDOWN = GpuType.overlap_slowdown
# HBM bytes per attention score element of unfused attention, forward + backward: bf16 scores written
# and read by the fused scale-mask-softmax (4), dropout read/write plus a 1-byte mask (5), AV reads the
# probabilities (2); backward reads them again and writes the score gradients (~2x): ~24 bytes.
UNFUSED_SCORE_BYTES = 24.0


class Env:
    """Everything that does not depend on the layout."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> None:
        self.model, self.train, self.cluster = model, train, cluster
        self.gpu = gpu = cluster.gpu
        self.counts: ParamCounts = param_counts(model)
        # Achieved speed by shape: the cluster's measured profile, else the catalogued curve (efficiency.py).
        self.profile = cluster.profile
        self.eff = Efficiency.for_gpu(gpu, cluster.profile, ranks_per_host=cluster.num_gpus)
        self.hbm_bw = self.eff.hbm_bw
        self._layer_cache: dict[tuple[int, int, bool], tuple[float, float, float, float]] = {}
        self.bytes_per_param = train.bytes_per_param
        # Adam step traffic per parameter: read grad, read+write master and moments, write bf16 param.
        bp, bg, bo = self.bytes_per_param
        self.opt_bytes_per_param = bg + 2 * bo + bp
        self.n, self.gpn, self.rack = cluster.num_gpus, cluster.gpn, cluster.rack_size
        self.s, self.g = train.seq_len, train.global_batch
        self.flops_per_step = flops_per_token(model, self.s) * self.g * self.s
        # Hoisted per-token FLOPs for Micro (forward + backward, and what recomputation adds).
        self.layer_flops = 6.0 * self.counts.matmul_active_per_layer + 12.0 * model.hidden * self.s
        self.recompute_flops = {
            rc: recompute_flops_per_token_layer(model, self.s, rc) for rc in ("none", "selective", "full")
        }
        self.ring_recompute_flops = ring_recompute_flops_per_token_layer(model, self.s)
        self.is_moe, self.reserve, self.capacity = model.is_moe, 1.0 * gpu.reserve_bytes, 1.0 * gpu.hbm_bytes
        self.node_tier = Tier("intra-node", *self.eff.link(gpu.nvlink_bw, gpu.intra_latency_s))
        self.rack_tier = Tier("inter-node", *self.eff.inter_link(gpu.internode_bw, gpu.inter_latency_s))
        self.cross_tier = Tier("inter-rack", self.rack_tier.bw / cluster.oversubscription,
                               self.rack_tier.latency)
        over = self.eff.step_overhead  # calibrated on 2 ranks, + the loss summary's all-gather over the world
        self.step_overhead = over and over + self.wider((("all_gather", 8.0 * self.n),), self.n, 1)

    def wider(self, moves: tuple[tuple[str, float], ...], n: int, count: int) -> float:
        """What `n` ranks add to an engine cost calibrated on the profile's (tiers.wider), as host work."""
        return self.eff.host * wider(moves, n, self.eff.ranks, self.node_tier, count)

    def layer_times(self, tokens: int, tp: int, sp: bool) -> tuple[float, float, float, float]:
        """(matmuls, attention core, elementwise, LM head) seconds of one layer's forward + backward for
        `tokens` tokens on one of `tp` ranks, each matmul timed from its (m, n, k) (efficiency.py)."""
        key = (tokens, tp, sp)
        if (hit := self._layer_cache.get(key)) is not None:
            return hit
        m, eff = self.model, self.eff
        h, hd, ffn = m.hidden, m.head_dim, (m.expert_ffn_dim if m.is_moe else m.ffn_dim)
        up = (2 if m.activation == "swiglu" else 1) * ffn
        # Forward shapes (Megatron TP: column-parallel QKV and MLP-up, row-parallel out and MLP-down);
        # backward's two GEMMs per matmul have the same dimensions permuted, hence the same time.
        shapes = ((tokens, max(1, (m.heads + 2 * m.n_kv_heads) * hd // tp), h), (tokens, h, max(1, h // tp)),
                  (tokens, max(1, up // tp), h), (tokens, h, max(1, ffn // tp)))  # fmt: skip
        flops = sum(2.0 * a * b * c for a, b, c in shapes)
        secs = sum(eff.matmul_time(a, b, c) for a, b, c in shapes)
        t_mm = tokens * 6.0 * self.counts.matmul_active_per_layer / tp * secs / flops
        t_attn = self._attention_time(tokens, tp)
        act_bytes = self.bytes_per_param[0]
        t_elem = eff.share_mm * eff.elementwise_time(tokens, h / (tp if sp else 1), ffn / tp, act_bytes)
        t_elem += eff.ops_time(t_mm + t_attn + t_elem)  # fixed cost per op (dispatch, launch)
        t_head = 3.0 * eff.matmul_time(tokens, max(1, m.vocab // tp), h)
        out = self._layer_cache[key] = (t_mm, t_attn, t_elem, t_head)
        return out

    def _attention_time(self, tokens: int, tp: int) -> float:
        """Attention core (QK^T, softmax, AV) forward + backward of `tokens` queries against the whole
        sequence on one of `tp` ranks: 12*h*s FLOPs per token (PaLM, Appendix B)."""
        m, s, eff = self.model, self.s, self.eff
        flops = tokens * 12.0 * m.hidden * s / tp
        if self.train.attention == "flash":
            # Flash attention skips the fully masked blocks of a causal mask: half the work (Dao 2023,
            # FlashAttention-2, Sec. 3.1).
            return 0.5 * flops / eff.attention_rate(s, m.head_dim)
        # Unfused: two batched GEMMs per head at matmul efficiency, plus the (b, heads, s, s) scores
        # through HBM: fused scale-mask-softmax, dropout (and its mask) forward, their gradients backward.
        heads = max(1, m.heads // tp) * tokens / s
        gemm = 3.0 * heads * (eff.matmul_time(s, s, m.head_dim) + eff.matmul_time(s, m.head_dim, s))
        return gemm + heads * s * s * UNFUSED_SCORE_BYTES / eff.hbm_bw

    def tier(self, span: int) -> Tier:
        """Slowest tier a group of `span` consecutive ranks crosses (rank order puts TP fastest)."""
        if span <= self.gpn and self.gpn % span == 0:
            return self.node_tier
        if self.n <= self.rack or (span <= self.rack and self.rack % span == 0):
            return self.rack_tier
        return self.cross_tier


class Family:
    """One (tp, cp, pp, dp, ep) split of the cluster, with `r` HSDP replicate groups (dp_replicate)."""

    # fmt: off
    __slots__ = ("env", "tp", "cp", "pp", "dp", "ep", "r", "d", "d_e", "d_shard", "tp_tier", "cp_tier",
        "dp_tier", "shard_tier", "pp_tier", "ep_tier", "p_layer_dense", "p_layer_expert", "emb", "head",
        "shadowed", "pipelined")
    # fmt: on

    def __init__(self, env: Env, tp: int, cp: int, pp: int, dp: int, ep: int, r: int = 1) -> None:
        self.env, self.tp, self.cp, self.pp, self.dp, self.ep, self.r = env, tp, cp, pp, dp, ep, r
        self.d = dp * cp  # ranks that hold the same parameters (CP ranks join the gradient reduction)
        self.d_e = self.d // ep  # ranks that hold the same experts
        # ZeRO-2/3 shard over d_shard consecutive DP ranks: all of them, or one of HSDP's r groups
        # (r > 1 only with cp = ep = 1, training.config.layout); the r groups all-reduce across dp_tier.
        self.d_shard = self.d // r
        self.tp_tier = env.tier(tp)
        self.cp_tier = env.tier(tp * cp)
        self.dp_tier = env.tier(tp * cp * dp)
        self.shard_tier = self.dp_tier if r == 1 else env.tier(tp * cp * dp // r)
        self.pp_tier = env.tier(env.n)  # the slowest stage boundary paces a synchronous pipeline
        self.ep_tier = env.tier(tp * ep)
        c = env.counts
        # Megatron TP shards the attention and MLP matmuls and the vocabulary; norms stay replicated.
        self.p_layer_dense = (c.attn + c.mlp + c.router) / tp + c.norms
        self.p_layer_expert = c.experts / (tp * ep)
        self.emb = c.embed / tp
        # A tied head is a second copy of the embedding when it lives on another pipeline rank.
        self.head = (c.head if c.head else (c.embed if pp > 1 else 0)) / tp + c.final_norm
        self.pipelined = pp > 1  # torch pipelining then drives FSDP2 (formulas.model_state_bytes)
        t = env.train
        # ZeRO-1 shadow shards where the engine keeps them (fp32, no CP/EP; used at ZeRO-1 only).
        self.shadowed = (t.shadow_optimizer and self.d > 1
                         and not shadow_conflicts(precision=t.precision, cp=cp, ep=ep))

    def key(self) -> tuple[int, ...]:
        return (self.tp, self.cp, self.pp, self.dp, self.ep, self.r)


class Stage:
    """The pipeline rank layout of a family: how many layers the busiest rank holds, and its model state."""

    # fmt: off
    __slots__ = ("fam", "v", "vshape", "layers", "same_rank", "state_first", "state_last", "buffers",
        "dp_once", "dp_per_mb", "dp_bytes_once", "dp_bytes_per_mb", "hsdp_once", "hsdp_bytes", "opt")
    # fmt: on

    def __init__(self, fam: Family, v: int, vshape: bool) -> None:
        env = fam.env
        self.fam, self.v, self.vshape = fam, v, vshape
        big_l = env.model.layers
        # Uneven splits: stages get floor or ceil(L / (p v)) layers; the busiest rank paces the pipeline.
        self.layers = min(big_l, v * math.ceil(big_l / (fam.pp * v)))
        self.same_rank = fam.pp == 1 or vshape
        dense = self.layers * fam.p_layer_dense
        expert = self.layers * fam.p_layer_expert
        if self.same_rank:
            first_dense = last_dense = dense + fam.emb + fam.head
        else:
            first_dense, last_dense = dense + fam.emb, dense + fam.head
        bpp = env.bytes_per_param
        self.state_first: list[tuple[float, float, float]] = []
        self.state_last: list[tuple[float, float, float]] = []
        self.buffers: list[float] = []
        shadow, pipe = fam.shadowed, fam.pipelined
        for z in range(4):
            d = fam.d_shard if z >= 2 else fam.d  # FSDP2 (ZeRO-2/3) shards within one HSDP group
            ed = model_state_bytes(expert, z, fam.d_e, bpp, fsdp2=True, pipelined=pipe)
            fd = model_state_bytes(first_dense, z, d, bpp, fsdp2=True, shadow=shadow, pipelined=pipe)
            ld = model_state_bytes(last_dense, z, d, bpp, fsdp2=True, shadow=shadow, pipelined=pipe)
            self.state_first.append((fd[0] + ed[0], fd[1] + ed[1], fd[2] + ed[2]))
            self.state_last.append((ld[0] + ed[0], ld[1] + ed[1], ld[2] + ed[2]))
            # ZeRO-3 gathers a layer before use and prefetches the next one (Zhao et al. 2023, FSDP).
            layer = fam.p_layer_dense + fam.p_layer_expert
            self.buffers.append(2 * bpp[0] * layer if z == 3 and fam.d_shard > 1 and not pipe else 0.0)
        # DP traffic of the busier rank, one collective per layer (bucket); dense and expert groups in turn.
        big = max(first_dense, last_dense)
        once = [0.0] * 4
        per_mb = [0.0] * 4
        bytes_once = [0.0] * 4
        bytes_per_mb = [0.0] * 4
        self.hsdp_once, self.hsdp_bytes = [0.0] * 4, [0.0] * 4
        groups = ((big, fam.d, fam.d_shard, fam.shard_tier), (expert, fam.d_e, fam.d_e, fam.dp_tier))
        for params, n, ns, shard_tier in groups:
            if n <= 1 or params <= 0:
                continue
            grad, weights = bpp[1] * params, bpp[0] * params
            ar = collective("all_reduce", grad, n, fam.dp_tier, self.layers)
            rs = collective("reduce_scatter", grad, n, fam.dp_tier, self.layers)
            ag = collective("all_gather", weights, ns, shard_tier, self.layers)
            # FSDP2 (ZeRO-2/3) reduce-scatters in fp32 (training/parallel/precision.fsdp_policy, torchtitan's
            # default); our own DDP/ZeRO-1 reduce in the gradients' dtype. Both within the shard group.
            rs32 = collective("reduce_scatter", max(bpp[1], 4) * params, ns, shard_tier, self.layers)
            # HSDP: the n/ns groups ring-all-reduce their fp32 gradient shards once per step (Zhao et al.
            # 2023, PyTorch FSDP, "hybrid sharding"; torchtitan's dp_replicate); 0 when n == ns.
            hs = collective("all_reduce", max(bpp[1], 4) * params / ns, n // ns, fam.dp_tier, self.layers)
            for z in (2, 3):
                self.hsdp_bytes[z] += hs[0]
                self.hsdp_once[z] += hs[1]
            # ZeRO-0: all-reduce once; ZeRO-1: reduce-scatter + all-gather once (same bytes, lecture 18:47);
            # ZeRO-2: reduce-scatter every micro-batch (grads stay sharded) + all-gather once;
            # ZeRO-3: all-gather forward and backward + reduce-scatter, every micro-batch (3x params).
            # Under PP the reduce-scatter runs once, after the last micro-batch (model_state_bytes).
            ag2 = plus(ag, ag)
            per_zero = ((ar, None), (plus(rs, ag), None),  # (once per step, every micro-batch), ZeRO 0-3
                (plus(ag, rs32), None) if pipe else (ag, rs32),
                (rs32, ag2) if pipe else (None, plus(ag2, rs32)),
            )
            for z, (o, p) in enumerate(per_zero):
                if o is not None:
                    bytes_once[z] += o[0]
                    once[z] += o[1]
                if p is not None:
                    bytes_per_mb[z] += p[0]
                    per_mb[z] += p[1]
        if expert <= 0:
            self._engine_dp(big, pipe, once, per_mb)
        self.dp_once, self.dp_per_mb = once, per_mb
        self.dp_bytes_once, self.dp_bytes_per_mb = bytes_once, bytes_per_mb
        self.opt = self._optimizer(big, expert)

    def _engine_dp(self, big: float, pipe: bool, once: list[float], per_mb: list[float]) -> None:
        """The engine's measured DP costs (training/calibration/engine.py) in place of the alpha-beta
        model where the profile has them, plus what a group spanning nodes adds on the slower tier."""
        fam, env, bpp = self.fam, self.fam.env, self.fam.env.bytes_per_param
        units = self.layers + 1  # a unit per block plus the root (embedding, head; training/parallel/fsdp.py)
        unit = env.eff.fsdp_unit_time(bpp[0] * big / units, fam.shard_tier.bw) if fam.d_shard > 1 else None
        if unit is not None and not pipe:
            # As FSDP2 issues it: per unit of the mean unit's size, its all-gathers and reduce-scatter
            # with their copies and hooks.
            weights, grads32 = bpp[0] * big, max(bpp[1], 4) * big
            moves = (("all_gather", weights), ("all_gather", weights), ("reduce_scatter", grads32))
            extra = off_node(moves, fam.d_shard, fam.shard_tier, env.node_tier, self.layers)
            per_mb[3] = units * unit + extra + env.wider(moves, fam.d_shard, self.layers)
        ddp = env.eff.ddp_step_time(bpp[1] * big, fam.dp_tier.bw) if fam.d > 1 else None
        if ddp is not None:  # as the engine's bucketed DDP issues it
            moves = (("all_reduce", bpp[1] * big),)
            once[0] = ddp + off_node(moves, fam.d, fam.dp_tier, env.node_tier, self.layers) + env.wider(
                moves, fam.d, self.layers)

    def _optimizer(self, big: float, expert: float) -> list[float]:
        """Seconds of the optimizer step for each ZeRO stage on the busiest rank."""
        fam, env = self.fam, self.fam.env
        eff, m = env.eff, env.model
        params = [big + expert, big / fam.d + expert / fam.d_e] + [big / fam.d_shard + expert / fam.d_e] * 2
        shadow = 2 if fam.shadowed else 1  # ZeRO-1 shadow shards: the successor's shard is stepped too
        params[1] *= shadow
        if eff.optimizer_param <= 0:  # memory-bound elementwise work on the (sharded) fp32 state
            return [p * env.opt_bytes_per_param / env.hbm_bw for p in params]
        # Measured as the engine steps (training/calibration/measure.py): per tensor and per parameter.
        per_layer = block_matrices(m) + 2  # q, k, v, o, the MLP's; two norms
        # + embedding, head (unless tied), final norm on one rank; the last stage's head and norm
        tensors = self.layers * per_layer + ((3 - m.tied_embeddings) if self.same_rank else 2)
        # Our ZeRO-1 steps only the tensors a rank owns (training/parallel/zero.py); FSDP2 every shard.
        owned = [tensors, shadow * tensors / fam.d, tensors, tensors]
        # FSDP2 (ZeRO-2/3) steps DTensor shards: each tensor costs what DTensor dispatch adds (measured).
        per_tensor = [eff.optimizer_tensor] * 2 + [eff.optimizer_tensor + eff.fsdp_optimizer_tensor] * 2
        return [n * t + p * eff.optimizer_param for n, t, p in zip(owned, per_tensor, params, strict=True)]


class Micro:
    """Per-layer activation bytes and per-micro-batch times for one (micro-batch size, sp, recompute)."""

    # fmt: off
    __slots__ = ("mbs", "sp", "recompute", "act_layer", "act_work", "act_emb", "logits", "loss_grad",
        "t_compute", "t_compute_plain", "t_head", "t_tp", "t_tp_edge", "t_cp", "t_ep", "t_layer", "t_p2p",
        "tp_bytes", "cp_bytes", "ep_bytes", "p2p_bytes")
    # fmt: on

    def __init__(self, fam: Family, mbs: int, sp: bool, recompute: str) -> None:
        env, m = fam.env, fam.env.model
        tp, cp = fam.tp, fam.cp
        self.mbs, self.sp, self.recompute = mbs, sp, recompute
        s, h = env.s, m.hidden
        s_loc = s // cp  # context parallel splits the sequence (queries); keys span all of it
        tokens = mbs * s_loc
        ring = cp > 1  # ring attention keeps a log-sum-exp, not the scores (formulas.py)
        self.act_layer = activation_bytes_per_layer(s_loc, mbs, h, m.heads, tp, sp, recompute, s, ring)
        # Full recomputation re-materialises one layer at a time during backward.
        self.act_work = (
            activation_bytes_per_layer(s_loc, mbs, h, m.heads, tp, sp, "selective", s, ring)
            if recompute == "full"
            else 0.0
        )
        self.act_emb = 2.0 * tokens * h / (tp if sp else 1)  # embedding output (bf16)
        self.logits = 6.0 * tokens * m.vocab / tp  # bf16 logits + fp32 log-softmax for the loss
        # Loss backward, all activations held: fp32 gradients of the log-softmax and of the logits at
        # once, not vocabulary-parallel (docs/planner.md; measured on an H200, docs/benchmarks.md).
        self.loss_grad = 8.0 * tokens * m.vocab
        if cp == 1 and not m.is_moe and env.train.attention == "flash":  # the engine's own saved tensors
            self.act_layer, self.act_work, self.act_emb, self.logits = engine_activation_terms(
                m, tokens, tp, sp, recompute, env.train.precision)
        t_mm, t_attn, t_elem, self.t_head = env.layer_times(tokens, tp, sp)
        self.t_compute_plain = t_mm + t_attn + t_elem
        # Recomputation repeats forwards (a third of forward + backward): the whole layer under "full",
        # the attention core under "selective" (Korthikanti et al. 2022, Sec. 5); ring attention's
        # backward recomputes QK^T, 2hs of the core's 12hs (formulas.ring_recompute_flops_per_token_layer).
        extra = {"full": self.t_compute_plain / 3.0, "selective": t_attn / 3.0}.get(recompute, 0.0)
        self.t_compute = self.t_compute_plain + extra + (t_attn / 6.0 if ring else 0.0)
        # TP: forward and backward, plus the recomputed forward under full recomputation.
        passes = 3 if recompute == "full" else 2
        self.tp_bytes = passes * tp_bytes_per_layer(mbs, s_loc, h, tp) if tp > 1 else 0.0
        self.t_tp = (
            self.tp_bytes / fam.tp_tier.bw + passes * 4 * hops(tp) * fam.tp_tier.latency if tp > 1 else 0.0
        )
        self.t_tp_edge = 0.0  # per micro-batch: the embedding's and the LM head's TP collectives
        message = tokens * h * env.bytes_per_param[0]  # one (tokens, h) activation or its gradient
        issued = env.eff.tp_linear_time(message, fam.tp_tier.bw) if tp > 1 else None
        if issued is not None and fam.tp_tier is env.node_tier and not m.is_moe:
            # Measured on this node type as the engine issues it (training/calibration/engine.py): each
            # sharded linear (q, k, v, o, MLP up / gate / down; training/parallel/tensor.py) costs its
            # DTensor dispatch and one all-reduce of the (tokens, h) activation; full recomputation
            # repeats the forward half. The row-parallel embedding and column-parallel head add two.
            linears = block_matrices(m)
            self.t_tp = passes / 2 * linears * issued
            self.t_tp_edge = 2 * issued
        # CP ring: (4cp-2) bf16 K/V blocks per layer (formulas.cp_ring_bytes_per_layer), one latency per
        # ring step (cp-1 forward, cp backward), overlapped with the attention blocks computed meanwhile.
        if ring:
            kv_local = 2.0 * tokens * m.n_kv_heads * m.head_dim * 2 / tp  # K and V of s/cp tokens, bf16
            self.cp_bytes = cp_ring_bytes_per_layer(kv_local, cp)
            ring_t = self.cp_bytes / fam.cp_tier.bw + (2 * cp - 1) * fam.cp_tier.latency
            attn_time = t_attn
            self.t_cp = max(0.0, ring_t - attn_time) + env.gpu.overlap_slowdown * min(ring_t, attn_time)
        else:
            self.cp_bytes, self.t_cp = 0.0, 0.0
        # EP: dispatch and combine all-to-alls, forward and backward, in the MoE share of the layers
        # (formulas.ep_all_to_all_bytes_per_layer). They sit between the router and the experts of one
        # micro-batch, so they overlap only with another micro-batch's compute: DualPipe (DeepSeek-AI
        # 2024, Sec. 3.2.1) and Megatron-Core's 1F1B all-to-all overlap pair a forward chunk with a
        # backward chunk; charged like the CP ring (exposed part + OVERLAP_SLOWDOWN of the hidden part).
        if env.is_moe and fam.ep > 1:
            frac = env.counts.moe_fraction
            self.ep_bytes = frac * ep_all_to_all_bytes_per_layer(tokens / tp, m.top_k, h, fam.ep)
            a2a = self.ep_bytes / fam.ep_tier.bw + frac * 4 * (fam.ep - 1) * fam.ep_tier.latency
            window = self.t_compute_plain
            self.t_ep = max(0.0, a2a - window) + env.gpu.overlap_slowdown * min(a2a, window)
        else:
            self.ep_bytes, self.t_ep = 0.0, 0.0
        self.t_layer = self.t_compute + self.t_tp + self.t_cp + self.t_ep
        # PP: one activation forward and one gradient backward per stage boundary per micro-batch,
        # b*s*h (lecture 45:18), scattered over TP ranks with sequence parallel (Narayanan et al. 2021, 4.1).
        if fam.pp > 1:
            self.p2p_bytes = 2.0 * 2.0 * tokens * h / (tp if sp else 1)
            self.t_p2p = self.p2p_bytes / fam.pp_tier.bw + 2 * fam.pp_tier.latency
        else:
            self.p2p_bytes, self.t_p2p = 0.0, 0.0


@dataclass(frozen=True, slots=True)
class Combo:
    """A pipeline schedule applied to a stage layout and a micro-batch shape."""

    m: int
    schedule: str
    t_mb: float  # busiest rank, one micro-batch, all its chunks
    compute_mb: float
    bubble: float
    core: float  # m micro-batches plus the bubble
    act_first: float
    act_last: float
    loss_first: float  # the loss backward's transient on the first / last stage (Micro.loss_grad)
    loss_last: float


def combine(stage: Stage, micro: Micro, schedule: str, m: int) -> Combo:
    pp, v = stage.fam.pp, stage.v
    t_mb = stage.layers * micro.t_layer + micro.t_head + micro.t_tp_edge + v * micro.t_p2p
    compute_mb = stage.layers * micro.t_compute + micro.t_head
    bubble = bubble_fraction(schedule, pp, m, v)
    # CPU ranks sharing cores (share > 1) fill each other's bubble: all work at the shared rate, or the
    core = m * t_mb * max((1.0 + bubble) / stage.fam.env.eff.share, 1.0)  # critical path at the solo one
    infl = inflight_microbatches(schedule, pp, m, v)
    act_first = (stage.layers * micro.act_layer + micro.act_emb) * infl + micro.act_work
    if stage.same_rank:
        act_first += micro.logits
        act_last = act_first
    else:
        infl_last = float(m) if schedule == "gpipe" else 1.0
        act_last = stage.layers * micro.act_layer * infl_last + micro.logits + micro.act_work
    g = micro.loss_grad
    return Combo(m, schedule, t_mb, compute_mb, bubble, core, act_first, act_last, g * stage.same_rank, g)


def dp_exposed(stage: Stage, combo: Combo, z: int) -> float:
    """DP time not hidden behind compute (Zhao et al. 2023, FSDP overlap).

    ZeRO-0/1 communicate once per step, overlapped with the last micro-batch's backward and the next
    step's first forward; ZeRO-2/3 every micro-batch, overlapped with all of them. The last bucket
    (about one layer's share) never overlaps, and what overlaps slows compute by OVERLAP_SLOWDOWN.
    HSDP's all-reduce across the replicas needs the last micro-batch's gradients (the engine defers
    only it, training/parallel/optim.py): one micro-batch's compute can hide it. Under PP all
    once-per-step collectives follow the flush (pipelining's REDUCE_GRAD; our DDP's no_grad_sync)."""
    hsdp, once = stage.hsdp_once[z], stage.dp_once[z]
    total = once + hsdp + combo.m * stage.dp_per_mb[z]
    window = combo.compute_mb * (combo.m if z >= 2 else 1)
    tail = once + hsdp if stage.fam.pipelined else hsdp - combo.compute_mb
    exposed = max(total - window, total / stage.layers, tail)
    return exposed + stage.fam.env.gpu.overlap_slowdown * (total - exposed)


def finish(stage: Stage, combo: Combo, z: int) -> tuple[float, float]:
    """(step time in seconds, peak bytes per GPU) of one complete candidate."""
    env = stage.fam.env
    # + the training loop's own host work per step (data, checks, loss summary), as calibrated.
    step = combo.core + dp_exposed(stage, combo, z) + stage.opt[z] + env.step_overhead
    sf, sl = stage.state_first[z], stage.state_last[z]
    extra = stage.buffers[z] + env.reserve
    mem = max(sf[0] + sf[1] + sf[2] + combo.act_first + combo.loss_first,
              sl[0] + sl[1] + sl[2] + combo.act_last + combo.loss_last) + extra
    return step, mem
