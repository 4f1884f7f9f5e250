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
    capacity_factor: float = 1.25
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
            raise SpecError(f"model.top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise SpecError(f"unknown model field(s): {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(known))}")
        return cls(**data)
