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
from service.planner import (
    ClusterSpec,
    LayoutRefused,
    PlannerError,
    TrainSpec,
    default_precision,
    get_preset,
    layout_gpus,
    plan_layout,
)
from service.planner.efficiency import HardwareProfile
from service.settings import Settings, get_settings
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
    """The cluster to plan for. A field left out is this service's own (the shape its jobs are planned
    on: `LATTICE_GPU_TYPE` and the embedded cluster's settings); `num_gpus` left out with a layout
    given is the layout's world size, as for a job."""

    model_config = ConfigDict(extra="forbid")

    gpu_type: str | None = Field(None, max_length=64, description="e.g. H100-80GB, A100-80GB, cpu-virtual; "
                                 "default: this service's GPU type")
    num_gpus: int | None = Field(None, ge=1, le=1 << 20, description="default: the layout's world size when "
                                 "tp, pp and dp are given, else this service's GPUs")
    gpus_per_node: int | None = Field(None, ge=1, le=1024, description="default: this service's for its "
                                      "own GPU type, else the catalogue's")
    nodes_per_rack: int | None = Field(None, ge=1, le=1 << 16, description="default: this service's for its "
                                       "own GPU type, else 4")
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
    precision: Literal["fp32", "bf16_fp32_adam", "bf16_fp32_master"] | None = Field(
        None, description="default: what a job on that GPU type trains in (fp32 on cpu-virtual, else "
        "bf16_fp32_adam)")
    cluster: ClusterIn = Field(default_factory=ClusterIn, description="default: this service's cluster")
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


def filled_cluster(body: PlanRequest, settings: Settings) -> ClusterIn:
    """The request's cluster with what it leaves out filled in as a job of this service is planned
    (service.api.operations.plan_job): its GPU type; its GPUs, or the world size of a layout that
    gives tp, pp and dp; its node shape for its own GPU type, else the planner's defaults
    (`Settings.node_shape`, as `lattice plan` does)."""
    c = body.cluster
    gpu_type = c.gpu_type if c.gpu_type is not None else settings.gpu_type
    num_gpus = c.num_gpus
    if num_gpus is None and body.layout is not None:
        num_gpus = layout_gpus(build_model(body.model), body.layout.model_dump(exclude_none=True),
                               body.global_batch, 0) or None
    gpus_per_node, nodes_per_rack = settings.node_shape(gpu_type)
    return ClusterIn(
        gpu_type=gpu_type, num_gpus=num_gpus or settings.embedded_num_gpus,
        gpus_per_node=c.gpus_per_node or gpus_per_node, nodes_per_rack=c.nodes_per_rack or nodes_per_rack,
        oversubscription=c.oversubscription,
    )


def plan_from_request(body: PlanRequest, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Plan dict for a request whose cluster is filled in (`filled_cluster`), with the measured
    `profile` document of its GPU type, if any; raises PlannerError / SpecError / LayoutError on bad
    values."""
    model = build_model(body.model)
    c = body.cluster
    if c.gpu_type is None or c.num_gpus is None:
        raise PlannerError("cluster.gpu_type and cluster.num_gpus must be filled in before planning")
    measured = HardwareProfile.from_dict(profile) if profile is not None else None
    cluster = ClusterSpec(c.gpu_type, c.num_gpus, c.gpus_per_node, c.nodes_per_rack or 4, c.oversubscription,
                          profile=measured)
    train = TrainSpec(global_batch=body.global_batch, seq_len=body.seq_len or model.seq_len,
                      precision=body.precision or default_precision(cluster.gpu_type))
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
    settings = getattr(request.app.state, "settings", None) or get_settings()  # a bare router: the defaults
    try:
        body = body.model_copy(update={"cluster": filled_cluster(body, settings)})
    except (PlannerError, SpecError, LayoutError) as e:  # a model or layout the fill cannot read
        raise fastapi.HTTPException(status_code=422, detail=str(e)) from e
    gpu = find_gpu(body.cluster.gpu_type or "")
    profile = profiles.get(gpu.name) if gpu is not None else None
    try:
        ok, value = await pool.run(plan_outcome, body, profile)
    except CpuBudgetExceeded as e:
        given = body.layout.model_dump(exclude_none=True) if body.layout is not None else {}
        raise search_too_large(pool.cpu_budget_s, given) from e
    if not ok:
        raise fastapi.HTTPException(status_code=422, detail=value)
    return value
