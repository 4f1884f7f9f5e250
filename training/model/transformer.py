"""A GPT-style decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU or GELU MLP,
optionally mixture-of-experts blocks, and context parallel attention.

Built from the planner's `ModelSpec`. Canonical parameter names (kept by every layout, so state
dicts, checkpoints and digests do not depend on how the model is split):

    tok_embeddings.weight
    layers.<i>.attention_norm.weight
    layers.<i>.attention.{wq,wk,wv,wo}.weight
    layers.<i>.ffn_norm.weight
    layers.<i>.feed_forward.{w1,w2,w3}.weight      (w3 only for swiglu)
    layers.<i>.feed_forward.router.weight          (MoE blocks, instead of w1/w2/w3)
    layers.<i>.feed_forward.{w_gate,w_up,w_down}   (MoE blocks: all experts stacked on dim 0)
    norm.weight
    output.weight                                   (absent when tied_embeddings)

A pipeline stage is the same class with the layers it does not own deleted and
`tok_embeddings` / `norm` / `output` set to None where absent (torchtitan's convention).

Initialisation is by name: every parameter is drawn from a generator seeded by (seed, name)
over its *full* shape, and a sharded parameter (DTensor) keeps the slice it owns. The same seed
therefore gives the same full weights for any layout, including a model built on the meta
device and materialised after tensor parallelism or FSDP. MoE blocks draw each expert from its
own (seed, layer, tensor, expert) generator (training/model/moe.py), so expert parallel ranks draw
only the experts they hold.

Context parallel (`set_context_parallel`, docs/context_parallel.md): the first stage takes the
full sequence of tokens and keeps this CP rank's load-balanced shard (chunks r and 2cp-1-r);
attention runs the ring over the CP group with RoPE at the tokens' global positions; `loss`
shards the targets the same way. Everything else is token-wise and needs nothing.

MoE (ModelSpec.num_experts > 0): the load-balancing loss of every MoE block enters the gradient
with weight `aux_loss_scale` through `_AuxLossGrad` (Megatron-LM's MoEAuxLossAutoScaler): the
block's output passes through unchanged and its backward also seeds d(aux) = scale. That works
on every pipeline stage without sending the aux values to the loss; `training.parallel.parallelize` sets
the scale to aux_loss_coef / num_microbatches (or aux_loss_coef under a pipeline schedule,
which divides the gradients itself). The reported loss is the language-model cross-entropy;
`aux_losses()` gives the last aux values.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from training.config.spec import ModelSpec
from training.model.moe import MoELayer
from training.parallel.context import cp_attention, cp_positions, shard_sequence
from training.parallel.wrapping import copy_full_into

# Wrapper prefixes that torch inserts into parameter names; stripped to get canonical names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
INIT_STD = 0.02  # GPT-2 / nanoGPT


def canonical_name(name: str) -> str:
    """The layout-independent name of a parameter (wrapper prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, each (seq_len, head_dim / 2) (Su et al. 2021, eq. 34)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, H, hd) by the angle of each position."""
    t = x.shape[1]
    x32 = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, hd/2, 2)
    x1, x2 = x32[..., 0], x32[..., 1]
    c, s = cos[:t, None, :], sin[:t, None, :]  # (T, 1, hd/2)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)  # (B, T, H, hd/2, 2)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (kv_heads divides heads)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.n_rep = spec.heads // spec.n_kv_heads  # query heads per key/value head
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=False)
        self.wk = nn.Linear(spec.hidden, spec.n_kv_heads * spec.head_dim, bias=False)
        self.wv = nn.Linear(spec.hidden, spec.n_kv_heads * spec.head_dim, bias=False)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=False)
        # Context parallel (set by Transformer.set_context_parallel): x holds this rank's shard.
        self.cp_group: ProcessGroup | None = None
        self.cp_rank, self.cp_size = 0, 1

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them.
        q = self.wq(x).view(bsz, t, -1, self.head_dim)  # (B, T, Hq, hd)
        k = self.wk(x).view(bsz, t, -1, self.head_dim)  # (B, T, Hkv, hd)
        v = self.wv(x).view(bsz, t, -1, self.head_dim)  # (B, T, Hkv, hd)
        if self.cp_size > 1:
            # The rank holds chunks r and 2cp-1-r of the sequence: rotate at their global positions.
            pos = cp_positions(t * self.cp_size, self.cp_rank, self.cp_size, device=cos.device)  # (T,)
            cos, sin = cos[pos], sin[pos]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Plain SDPA without CP, ring attention over the CP group with it; K/V keep Hkv heads (GQA).
        y = cp_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.cp_group, causal=True
        )  # (B, Hq, T, hd)
        y = y.transpose(1, 2).reshape(bsz, t, -1)  # (B, T, Hq * hd)
        return self.wo(y)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020: w2(silu(w1 x) * w3 x)) or the GPT-2 GELU MLP (w2(gelu(w1 x)))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.swiglu = spec.activation == "swiglu"
        self.w1 = nn.Linear(spec.hidden, spec.ffn_dim, bias=False)
        self.w2 = nn.Linear(spec.ffn_dim, spec.hidden, bias=False)
        self.w3 = nn.Linear(spec.hidden, spec.ffn_dim, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))  # (B, T, C)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the block output whose backward also seeds d(aux) = scale (Megatron-LM's
    MoEAuxLossAutoScaler): the aux loss joins the gradient on whatever stage computed it."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor, aux: torch.Tensor,  # type: ignore[override]
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor  # type: ignore[override]
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class TransformerBlock(nn.Module):
    """Pre-norm block. `recompute` is set by `training.parallel.parallelize` (none | selective | full)."""

    def __init__(self, spec: ModelSpec, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attention = Attention(spec)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.is_moe = spec.is_moe_layer(layer_id)
        self.feed_forward: nn.Module
        if self.is_moe:
            # Weights are redrawn by Transformer.init_weights from (seed, layer name).
            self.feed_forward = MoELayer(spec.hidden, spec.expert_ffn_dim, spec.num_experts, spec.top_k,
                                         spec.capacity_factor, activation=spec.activation)
        else:
            self.feed_forward = FeedForward(spec)
        self.recompute = "none"
        self.aux_loss_scale = spec.aux_loss_coef  # weight of d(aux) in backward (MoE blocks)
        self.last_aux: torch.Tensor | None = None

    def _attention_branch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.attention(self.attention_norm(x), cos, sin)

    def _block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "selective":
            h = x + checkpoint(self._attention_branch, x, cos, sin, use_reentrant=False)
        else:
            h = x + self._attention_branch(x, cos, sin)
        if not self.is_moe:
            return h + self.feed_forward(self.ffn_norm(h))
        y, aux = self.feed_forward(self.ffn_norm(h))  # dropped tokens: y = 0, the residual carries them
        self.last_aux = aux.detach()
        out = h + y  # (B, T, C)
        if self.aux_loss_scale and out.requires_grad:
            out = _AuxLossGrad.apply(out, aux, self.aux_loss_scale)
        return out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self._block, x, cos, sin, use_reentrant=False)
        return self._block(x, cos, sin)


class Transformer(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab); a pipeline stage maps activations to activations."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.hidden, spec.norm_eps)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the spec, recomputed by init_weights after a meta build.
        cos, sin = rope_tables(spec.head_dim, spec.seq_len, spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.cp_group: ProcessGroup | None = None
        self.cp_rank, self.cp_size = 0, 1

    # ---- parallel settings (training.parallel.parallelize calls these) ---------------------------------
    def set_context_parallel(self, cp_group: ProcessGroup | None) -> None:
        """Run attention as a ring over `cp_group`; tokens and targets are sharded along the sequence."""
        size = dist.get_world_size(cp_group) if cp_group is not None else 1
        rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self.cp_group, self.cp_rank, self.cp_size = (cp_group if size > 1 else None), rank, size
        for block in self.layers.values():
            attn = block.attention
            attn.cp_group, attn.cp_rank, attn.cp_size = self.cp_group, rank, size

    def set_aux_loss_scale(self, scale: float) -> None:
        """Weight of each MoE block's aux loss in the gradient (coef / micro-batches per step)."""
        for block in self.layers.values():
            block.aux_loss_scale = scale

    def moe_layers(self) -> list[MoELayer]:
        return [b.feed_forward for b in self.layers.values() if b.is_moe]

    def aux_losses(self) -> list[float]:
        """The aux loss of every MoE block of this part in the last forward (this rank's aux_r)."""
        return [float(b.last_aux) for b in self.layers.values() if b.is_moe and b.last_aux is not None]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens; `targets` is the full sequence (sharded for CP)."""
        return sharded_cross_entropy(logits, targets, self.cp_rank, self.cp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            if self.cp_size > 1:
                x = shard_sequence(x, self.cp_rank, self.cp_size, dim=1)  # (B, T/cp): chunks r, 2cp-1-r
            h = self.tok_embeddings(x)  # (B, T, C)
        else:
            h = x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)  # (B, T, C)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # (B, T, V) or (B, T, C)

    def tie_weights(self) -> None:
        """Share the embedding with the head again (to_empty() on a meta model unties them)."""
        if self.spec.tied_embeddings and self.output is not None and self.tok_embeddings is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    # ---- initialisation ---------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer deterministically from (seed, canonical name)."""
        self.tie_weights()
        device = self.rope_cos.device
        cos, sin = rope_tables(self.spec.head_dim, self.spec.seq_len, self.spec.rope_theta, device=device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        moe_prefixes = tuple(f"layers.{k}.feed_forward." for k, b in self.layers.items() if b.is_moe)
        for name, param in self.named_parameters():
            cname = canonical_name(name)
            if cname.startswith(moe_prefixes):  # drawn per expert below
                continue
            full = init_tensor(self.spec, cname, tuple(param.shape), seed)
            copy_full_into(param, full)
        for key, block in self.layers.items():
            if block.is_moe:
                block.feed_forward.reset_parameters(_name_seed(seed, f"layers.{key}.feed_forward"))


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full float32 initial value of the parameter `name` (on CPU)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = INIT_STD
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std = INIT_STD / math.sqrt(2 * spec.layers)  # residual projections, GPT-2 paper section 2.3
    gen = torch.Generator().manual_seed(_name_seed(seed, name))
    return torch.randn(shape, generator=gen) * std



def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens of the (micro-)batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cp_rank: int, cp_size: int
                          ) -> torch.Tensor:
    """Cross-entropy of a CP rank's logits (B, T/cp, V) against its shard of the full targets (B, T).

    Every CP rank holds T/cp tokens, so the mean of the ranks' means is the full-sequence mean and
    averaging gradients over dp x cp gives its gradient (docs/context_parallel.md).
    """
    if cp_size > 1 and targets.size(1) != logits.size(1):
        targets = shard_sequence(targets, cp_rank, cp_size, dim=1)  # (B, T/cp), the same chunks as x
    return cross_entropy_loss(logits, targets)


def build_model(spec: ModelSpec, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """The full model, initialised (no parallelism); on "meta" it is left uninitialised."""
    with torch.device(device):
        model = Transformer(spec)
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model


def prune_to_stage(model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """Keep only the layers of one pipeline stage, with their canonical names (in place)."""
    for key in list(model.layers.keys()):
        if int(key) not in layer_ids:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    return model
