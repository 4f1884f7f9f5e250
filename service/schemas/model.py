"""The model of a job spec: a preset by name or an explicit shape."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
    model_validator,
)

from training.config.spec import ModelSpec, SpecError

if TYPE_CHECKING:
    pass
from service.schemas.common import MAX_DEGREE, StrictModel


def _without_unset_init(data: dict[str, Any]) -> dict[str, Any]:
    """Stored specs name `init_from` only when given (older specs and their hashes stay as they were)."""
    if data.get("init_from") is None:
        data.pop("init_from", None)
    return data


class InitFrom(StrictModel):
    """Pretrained weights to start from (training.interop); the optimizer starts fresh."""

    path: str = Field(min_length=1, max_length=4096, description=(
        "An export folder (or its weights file) inside the data root: relative to it, or absolute under it."))
    format: Literal["hf", "torch"] = Field(
        "hf", description="hf: config.json + model.safetensors (Llama/Mixtral); torch: model.pt + model.json."
    )


class ModelPreset(StrictModel):
    init_from: InitFrom | None = Field(None, description="Start from these weights (shapes must match).")
    preset: str = Field(
        min_length=1,
        max_length=64,
        description="Name of a model preset known to the planner.",
        examples=["demo", "gpt2-small", "llama3-8b"],
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_init(handler(self))


class ModelConfig(StrictModel):
    """An explicit decoder-only transformer (the fields of training.config.spec.ModelSpec)."""

    layers: int = Field(ge=1, le=100_000, description="Transformer blocks.")
    hidden: int = Field(ge=1, le=MAX_DEGREE, description="Model width; divisible by heads.")
    heads: int = Field(ge=1, le=65_536, description="Attention heads.")
    vocab: int = Field(ge=1, le=100_000_000, description="Vocabulary size.")
    seq_len: int = Field(ge=1, le=100_000_000, description="Sequence length in tokens.")
    kv_heads: int | None = Field(None, ge=1, le=65_536, description="Key/value heads (GQA); unset = heads.")
    ffn: int | None = Field(
        None, ge=1, le=MAX_DEGREE * 8, description="MLP width; unset = derived from hidden."
    )
    tied_embeddings: bool = Field(False, description="Share input embedding and output projection.")
    activation: Literal["swiglu", "gelu"] = Field("swiglu", description="MLP activation (Llama or GPT-2).")
    norm_eps: float = Field(1e-5, gt=0, le=1, description="Normalisation epsilon.")
    rope_theta: float = Field(10000.0, gt=0, le=1e12, description="RoPE base.")
    num_experts: int = Field(0, ge=0, le=65_536, description="MoE experts; 0 = dense.")
    top_k: int = Field(2, ge=1, le=65_536, description="Experts per token (MoE).")
    expert_ffn: int | None = Field(
        None, ge=1, le=MAX_DEGREE * 8, description="Expert MLP width; unset = ffn."
    )
    capacity_factor: float | None = Field(
        1.25, gt=0, le=64, description="MoE expert capacity factor; null = no token dropping."
    )
    aux_loss_coef: float = Field(
        0.01, ge=0, le=10, description="Weight of the MoE load-balancing auxiliary loss (Switch: 0.01)."
    )
    moe_layer_freq: int = Field(1, ge=1, le=1024, description="Every n-th block is MoE, the others dense.")
    name: str = Field("custom", min_length=1, max_length=64, description="Label for the model.")
    init_from: InitFrom | None = Field(None, description="Start from these weights (shapes must match).")

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        try:
            self.to_model_spec()
        except SpecError as e:
            raise ValueError(str(e)) from e
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_init(handler(self))

    def to_model_spec(self) -> ModelSpec:
        return ModelSpec(**self.model_dump(exclude={"init_from"}))


def _model_kind(value: Any) -> str:
    if isinstance(value, dict) and "preset" in value:
        return "by_preset"
    if isinstance(value, ModelPreset):
        return "by_preset"
    return "explicit"


ModelField = Annotated[
    Annotated[ModelPreset, Tag("by_preset")] | Annotated[ModelConfig, Tag("explicit")],
    Discriminator(
        _model_kind,
        custom_error_type="model_kind",
        custom_error_message="model must be {preset: NAME} or an explicit model object",
    ),
]
