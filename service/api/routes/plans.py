"""POST /v1/plans: plan a parallel layout (search), fill in a partial one, or predict a given one.

Thin: the body becomes a ModelSpec / TrainSpec / ClusterSpec (and the given layout fields), and
service.planner.plan_layout answers with a Plan, as for a job's `parallelism`. Errors:
  - a body that does not match the schema -> FastAPI's RequestValidationError (422);
  - values the planner rejects (unknown GPU or preset, heads not divisible, a model that fits
    nowhere, an impossible layout) -> HTTPException(422, detail="<field>: <what is allowed>");
  - a search over its CPU budget -> 422 "search too large" naming the layout fields to pin.
The search runs in the planning process pool (service.api.planning).
The router carries no auth dependency: the app mounts it with its own (`include_router(router,
dependencies=[...])`).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import fastapi
from pydantic import BaseModel, ConfigDict, Field

from service.api.planning import CpuBudgetExceeded, plan_pool_for, search_too_large
from service.api.responses import ModelResponseRoute
from service.planner import ClusterSpec, LayoutRefused, PlannerError, TrainSpec, get_preset, plan_layout
from service.planner.efficiency import HardwareProfile
from service.store.profiles import newest_profiles
from training.config.hardware import find_gpu
from training.config.layout import LayoutError
from training.config.spec import ModelSpec, SpecError

router = fastapi.APIRouter(tags=["plans"], route_class=ModelResponseRoute)


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
    """Any subset of Layout's fields; the planner fills in the rest (service.planner.plan_layout)."""

    model_config = ConfigDict(extra="forbid")

    tp: int | None = Field(None, ge=1, le=1 << 20)
    pp: int | None = Field(None, ge=1, le=1 << 20)
    dp: int | None = Field(None, ge=1, le=1 << 20)
    cp: int | None = Field(None, ge=1, le=1 << 20)
    ep: int | None = Field(None, ge=1, le=1 << 20)
    zero_stage: int | None = Field(None, ge=0, le=3)
    micro_batch_size: int | None = Field(None, ge=1, le=1 << 24)
    num_microbatches: int | None = Field(None, ge=1, le=1 << 24)
    schedule: str | None = Field(None, max_length=64)
    sequence_parallel: bool | None = None
    recompute: str | None = Field(None, max_length=32)
    virtual_stages: int | None = Field(None, ge=1, le=4096)
    dp_replicate: int | None = Field(None, ge=1, le=1 << 20)


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelIn
    global_batch: int = Field(..., ge=1, le=1 << 24, description="sequences per optimizer step")
    seq_len: int | None = Field(None, ge=1, le=1 << 24, description="defaults to model.seq_len")
    precision: Literal["fp32", "bf16_fp32_adam", "bf16_fp32_master"] = "bf16_fp32_adam"
    cluster: ClusterIn
    zero_stages: list[int] | None = Field(
        None, min_length=1, max_length=4, description="stages the search may use"
    )
    layout: LayoutIn | None = Field(
        None,
        description="keep these layout fields (any subset); the planner fills in the rest, or evaluates "
        "the layout when it runs as given",
    )
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


def plan_from_request(body: PlanRequest, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Plan dict for a request (with the measured `profile` document of its GPU type, if any);
    raises PlannerError / SpecError / LayoutError on bad values."""
    model = build_model(body.model)
    train = TrainSpec(
        global_batch=body.global_batch, seq_len=body.seq_len or model.seq_len, precision=body.precision
    )
    c = body.cluster
    measured = HardwareProfile.from_dict(profile) if profile is not None else None
    cluster = ClusterSpec(
        c.gpu_type, c.num_gpus, c.gpus_per_node, c.nodes_per_rack, c.oversubscription, profile=measured
    )
    given = body.layout.model_dump(exclude_none=True) if body.layout is not None else None
    zero_stages = tuple(body.zero_stages) if body.zero_stages is not None else (0, 1, 2, 3)
    return plan_layout(model, train, cluster, given, zero_stages=zero_stages, top_k=body.top_k).to_dict()


def plan_outcome(body: PlanRequest, profile: dict[str, Any] | None = None) -> tuple[bool, Any]:
    """In a planning worker process: (True, the Plan dict) or (False, the 422 detail)."""
    try:
        return True, plan_from_request(body, profile)
    except LayoutRefused as e:
        return False, f"layout: {e}"
    except (PlannerError, SpecError, LayoutError) as e:
        return False, str(e)


def _profiles(request: fastapi.Request) -> dict[str, Any]:
    """node type -> the newest measured profile document (a sync dependency: read in a worker thread);
    empty for an app without a store (a planning-only app)."""
    factory = getattr(request.app.state, "read_session_factory", None)
    if factory is None:
        return {}
    with factory() as session:
        return {k: p.to_dict() for k, p in newest_profiles(session).items()}


@router.post("/v1/plans", summary="Plan a parallel layout (or evaluate one) for a model on a cluster")
async def create_plan(
    body: PlanRequest,
    request: fastapi.Request,
    profiles: Annotated[dict[str, Any], fastapi.Depends(_profiles)],
) -> dict[str, Any]:
    """The search runs in the planning pool (service.api.planning), never on the event loop. A GPU type
    with a measured profile (`lattice calibrate`) is planned with its newest one."""
    pool = plan_pool_for(request.app.state)
    gpu = find_gpu(body.cluster.gpu_type)
    profile = profiles.get(gpu.name) if gpu is not None else None
    try:
        ok, value = await pool.run(plan_outcome, body, profile)
    except CpuBudgetExceeded as e:
        given = body.layout.model_dump(exclude_none=True) if body.layout is not None else {}
        raise search_too_large(pool.cpu_budget_s, given) from e
    if not ok:
        raise fastapi.HTTPException(status_code=422, detail=value)
    return value
