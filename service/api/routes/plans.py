"""POST /v1/plans: plan a parallel layout (search), or predict a given one (evaluate).

Thin: the body becomes a ModelSpec / TrainSpec / ClusterSpec (and a Layout in evaluate mode), the
planner answers with a Plan. Errors:
  - a body that does not match the schema -> FastAPI's RequestValidationError (422);
  - values the planner rejects (unknown GPU or preset, heads not divisible, a model that fits
    nowhere, an impossible layout) -> HTTPException(422, detail="<field>: <what is allowed>").
The router carries no auth dependency: the app mounts it with its own (`include_router(router,
dependencies=[...])`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import fastapi
from pydantic import BaseModel, ConfigDict, Field

from service.planner import ClusterSpec, Layout, PlannerError, TrainSpec, evaluate, get_preset, plan
from training.config.layout import LayoutError
from training.config.spec import ModelSpec, SpecError

router = fastapi.APIRouter(tags=["plans"])


class ModelIn(BaseModel):
    """A preset name, explicit shape fields, or a preset with some fields overridden."""

    model_config = ConfigDict(extra="forbid")

    preset: str | None = Field(None, max_length=64, description="e.g. llama3-70b, gpt2-small, demo")
    layers: int | None = Field(None, ge=1, le=4096)
    hidden: int | None = Field(None, ge=1, le=1 << 20)
    heads: int | None = Field(None, ge=1, le=4096)
    kv_heads: int | None = Field(None, ge=1, le=4096)
    ffn: int | None = Field(None, ge=1, le=1 << 22)
    vocab: int | None = Field(None, ge=1, le=1 << 24)
    seq_len: int | None = Field(None, ge=1, le=1 << 24)
    tied_embeddings: bool | None = None
    activation: Literal["swiglu", "gelu"] | None = None
    num_experts: int | None = Field(None, ge=0, le=4096)
    top_k: int | None = Field(None, ge=1, le=4096)
    expert_ffn: int | None = Field(None, ge=1, le=1 << 22)
    name: str | None = Field(None, max_length=128)


class ClusterIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_type: str = Field(..., max_length=64, description="e.g. H100-80GB, A100-80GB, cpu-virtual")
    num_gpus: int = Field(..., ge=1, le=1 << 20)
    gpus_per_node: int | None = Field(None, ge=1, le=1024)
    nodes_per_rack: int = Field(4, ge=1, le=1 << 16)
    oversubscription: float = Field(1.0, ge=1.0, le=1000.0, allow_inf_nan=False)


class LayoutIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(1, ge=1, le=1 << 20)
    pp: int = Field(1, ge=1, le=1 << 20)
    dp: int = Field(1, ge=1, le=1 << 20)
    cp: int = Field(1, ge=1, le=1 << 20)
    ep: int = Field(1, ge=1, le=1 << 20)
    zero_stage: int = Field(0, ge=0, le=3)
    micro_batch_size: int = Field(1, ge=1, le=1 << 24)
    num_microbatches: int = Field(1, ge=1, le=1 << 24)
    schedule: str = Field("none", max_length=64)
    sequence_parallel: bool = False
    recompute: str = Field("none", max_length=32)
    virtual_stages: int = Field(1, ge=1, le=4096)


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelIn
    global_batch: int = Field(..., ge=1, le=1 << 24, description="sequences per optimizer step")
    seq_len: int | None = Field(None, ge=1, le=1 << 24, description="defaults to model.seq_len")
    precision: Literal["bf16_fp32_adam", "bf16_fp32_master"] = "bf16_fp32_adam"
    cluster: ClusterIn
    zero_stages: list[int] | None = Field(
        None, min_length=1, max_length=4, description="stages the search may use"
    )
    layout: LayoutIn | None = Field(None, description="evaluate this layout instead of searching")
    top_k: int = Field(5, ge=0, le=50)


def build_model(body: ModelIn) -> ModelSpec:
    """ModelSpec from a preset (given fields override it) or explicit fields; PlannerError or SpecError."""
    fields = body.model_dump(exclude_none=True, exclude={"preset"})
    if body.preset is not None:
        base = get_preset(body.preset)
        return dataclasses.replace(base, **fields) if fields else base
    missing = [f for f in ("layers", "hidden", "heads", "vocab", "seq_len") if f not in fields]
    if missing:
        raise PlannerError(
            f"model: give a preset or all of layers, hidden, heads, vocab, seq_len (missing: "
            f"{', '.join(missing)})"
        )
    return ModelSpec(**fields)


def plan_from_request(body: PlanRequest) -> dict[str, Any]:
    """The Plan dict for a request; raises PlannerError / SpecError / LayoutError on bad values."""
    model = build_model(body.model)
    train = TrainSpec(
        global_batch=body.global_batch, seq_len=body.seq_len or model.seq_len, precision=body.precision
    )
    c = body.cluster
    cluster = ClusterSpec(c.gpu_type, c.num_gpus, c.gpus_per_node, c.nodes_per_rack, c.oversubscription)
    if body.layout is not None:
        layout = Layout(**body.layout.model_dump())
        return evaluate(model, train, cluster, layout, compare_with_search=False).to_dict()
    zero_stages = tuple(body.zero_stages) if body.zero_stages is not None else (0, 1, 2, 3)
    return plan(model, train, cluster, zero_stages=zero_stages, top_k=body.top_k).to_dict()


@router.post("/v1/plans", summary="Plan a parallel layout (or evaluate one) for a model on a cluster")
def create_plan(body: PlanRequest) -> dict[str, Any]:
    try:
        return plan_from_request(body)
    except (PlannerError, SpecError, LayoutError) as e:
        raise fastapi.HTTPException(status_code=422, detail=str(e)) from e
