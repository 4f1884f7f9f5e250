"""Model shape shared by the planner and the training engine (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class SpecError(ValueError):
    """A model spec that cannot be built; the message names the field and what is allowed."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (dense, or MoE when num_experts > 0)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None  # None = heads (no GQA)
    ffn: int | None = None  # None = 4 * hidden (gelu) or the Llama 8/3 rule rounded (swiglu)
    tied_embeddings: bool = False
    activation: str = "swiglu"  # "swiglu" (Llama) or "gelu" (GPT-2)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # MoE: 0 experts means a dense model.
    num_experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    # Assignments an expert accepts per step, as a multiple of its fair share; None never drops
    # (Switch Transformer eq. 3; training/model/moe.py).
    capacity_factor: float | None = 1.25
    # Weight of the load-balancing loss in the training loss (Switch Transformer section 2.2: 0.01).
    aux_loss_coef: float = 0.01
    # Every moe_layer_freq-th block is MoE (blocks k-1, 2k-1, ...; GShard uses 2), the others dense.
    moe_layer_freq: int = 1
    name: str = "custom"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for field in ("layers", "hidden", "heads", "vocab", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"model.{field} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads != 0:
            raise SpecError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})")
        kv = self.n_kv_heads
        if kv < 1 or self.heads % kv != 0:
            raise SpecError(f"model.kv_heads ({kv}) must be >= 1 and divide model.heads ({self.heads})")
        if self.ffn is not None and self.ffn < 1:
            raise SpecError(f"model.ffn must be >= 1, got {self.ffn}")
        if self.activation not in ("swiglu", "gelu"):
            raise SpecError(f"model.activation must be 'swiglu' or 'gelu', got {self.activation!r}")
        if self.num_experts < 0:
            raise SpecError(f"model.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise SpecError(
                f"model.top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise SpecError(
                f"model.capacity_factor must be > 0 or null (no dropping), got {self.capacity_factor}"
            )
        if not self.aux_loss_coef >= 0:
            raise SpecError(f"model.aux_loss_coef must be >= 0, got {self.aux_loss_coef}")
        freq = self.moe_layer_freq
        if not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise SpecError(f"model.moe_layer_freq must be an integer >= 1, got {self.moe_layer_freq!r}")
        if self.head_dim % 2 != 0:
            raise SpecError(f"model.hidden / model.heads ({self.head_dim}) must be even for RoPE")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.activation == "gelu":
            return 4 * self.hidden
        # Llama: 2/3 of 4h, rounded up to a multiple of 64.
        return ((int(8 * self.hidden / 3) + 63) // 64) * 64

    @property
    def expert_ffn_dim(self) -> int:
        return self.expert_ffn if self.expert_ffn is not None else self.ffn_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has an MoE feed-forward (every moe_layer_freq-th block)."""
        return self.is_moe and layer % self.moe_layer_freq == self.moe_layer_freq - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise SpecError(
                f"unknown model field(s): {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**data)
