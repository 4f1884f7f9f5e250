"""The API's data shapes: `JobSpec` (what a user submits) and the public views of jobs and events.

Validation lives here, so every way into Lattice (HTTP, CLI, tests) refuses the same bad
input with the same message, naming the field and what is allowed. The model shape and the
layout are validated by their owners (training.config.spec.ModelSpec, training.config.layout.Layout); this
module only translates their errors into field errors.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from training.config.layout import RECOMPUTE, SCHEDULES, Layout, LayoutError
from training.config.run import CheckpointConfig, DataConfig, IntegrityConfig, OptimConfig, RunConfig
from training.config.spec import ModelSpec, SpecError
from training.config.validate import check_layout_for_model
from workers.faults import FaultError, normalize_fault

if TYPE_CHECKING:
    from service.store.models import Job, JobEvent

# Database integer columns are 32-bit; keep every stored count well inside.
_MAX_COUNT = 1_000_000_000
_MAX_DEGREE = 1 << 20
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\- ]*$"

JobStateName = Literal[
    "pending", "queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled"
]


class _Strict(BaseModel):
    """Unknown fields are errors; NaN/inf are not numbers a job can use."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# ---- model -------------------------------------------------------------------------------------
class ModelPreset(_Strict):
    preset: str = Field(
        min_length=1,
        max_length=64,
        description="Name of a model preset known to the planner.",
        examples=["demo", "gpt2-small", "llama3-8b"],
    )


class ModelConfig(_Strict):
    """An explicit decoder-only transformer (the fields of training.config.spec.ModelSpec)."""

    layers: int = Field(ge=1, le=100_000, description="Transformer blocks.")
    hidden: int = Field(ge=1, le=_MAX_DEGREE, description="Model width; divisible by heads.")
    heads: int = Field(ge=1, le=65_536, description="Attention heads.")
    vocab: int = Field(ge=1, le=100_000_000, description="Vocabulary size.")
    seq_len: int = Field(ge=1, le=100_000_000, description="Sequence length in tokens.")
    kv_heads: int | None = Field(None, ge=1, le=65_536, description="Key/value heads (GQA); unset = heads.")
    ffn: int | None = Field(
        None, ge=1, le=_MAX_DEGREE * 8, description="MLP width; unset = derived from hidden."
    )
    tied_embeddings: bool = Field(False, description="Share input embedding and output projection.")
    activation: Literal["swiglu", "gelu"] = Field("swiglu", description="MLP activation (Llama or GPT-2).")
    norm_eps: float = Field(1e-5, gt=0, le=1, description="Normalisation epsilon.")
    rope_theta: float = Field(10000.0, gt=0, le=1e12, description="RoPE base.")
    num_experts: int = Field(0, ge=0, le=65_536, description="MoE experts; 0 = dense.")
    top_k: int = Field(2, ge=1, le=65_536, description="Experts per token (MoE).")
    expert_ffn: int | None = Field(
        None, ge=1, le=_MAX_DEGREE * 8, description="Expert MLP width; unset = ffn."
    )
    capacity_factor: float | None = Field(
        1.25, gt=0, le=64, description="MoE expert capacity factor; null = no token dropping."
    )
    aux_loss_coef: float = Field(
        0.01, ge=0, le=10, description="Weight of the MoE load-balancing auxiliary loss (Switch: 0.01)."
    )
    moe_layer_freq: int = Field(1, ge=1, le=1024, description="Every n-th block is MoE, the others dense.")
    name: str = Field("custom", min_length=1, max_length=64, description="Label for the model.")

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        try:
            self.to_model_spec()
        except SpecError as e:
            raise ValueError(str(e)) from e
        return self

    def to_model_spec(self) -> ModelSpec:
        return ModelSpec(**self.model_dump())


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


# ---- data, training --------------------------------------------------------------------------
class DataSpec(_Strict):
    kind: Literal["synthetic", "tokens"] = Field(
        "synthetic",
        description="synthetic: a deterministic task whose loss falls; tokens: a uint16 token file.",
    )
    path: str | None = Field(None, min_length=1, max_length=4096, description="Token file, for kind=tokens.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Data order seed.")

    @model_validator(mode="after")
    def _path_for_tokens(self) -> DataSpec:
        if self.kind == "tokens" and not self.path:
            raise ValueError("data.path is required when data.kind is 'tokens'")
        return self


class TrainConfig(_Strict):
    steps: int = Field(ge=1, le=_MAX_COUNT, description="Optimizer steps.")
    global_batch: int = Field(ge=1, le=_MAX_COUNT, description="Sequences per optimizer step.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    grad_clip: float | None = Field(
        None, gt=0, le=1e6, description="Global gradient-norm clip; unset = none."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Initialisation seed.")
    precision: Literal["bf16_fp32_adam", "bf16_fp32_master"] = Field(
        "bf16_fp32_adam", description="Mixed precision recipe (the planner counts its bytes per parameter)."
    )
    dp_impl: Literal["lattice", "torch"] = Field(
        "lattice", description="Data-parallel implementation at zero_stage 0: Lattice's DDP or torch DDP."
    )


# ---- parallelism ------------------------------------------------------------------------------
class LayoutSpec(_Strict):
    """An explicit parallel layout (the fields of training.config.layout.Layout)."""

    tp: int = Field(1, ge=1, le=_MAX_DEGREE, description="Tensor parallel degree (inside one node).")
    pp: int = Field(1, ge=1, le=_MAX_DEGREE, description="Pipeline parallel degree.")
    dp: int = Field(1, ge=1, le=_MAX_DEGREE, description="Data parallel degree.")
    cp: int = Field(1, ge=1, le=_MAX_DEGREE, description="Context parallel degree.")
    ep: int = Field(1, ge=1, le=_MAX_DEGREE, description="Expert parallel degree (carved out of dp x cp).")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage: 0 DDP, 1/2 sharded state, 3 FSDP.")
    micro_batch_size: int = Field(1, ge=1, le=_MAX_DEGREE, description="Sequences per micro-batch.")
    num_microbatches: int = Field(
        1, ge=1, le=_MAX_DEGREE, description="Micro-batches per step (per DP rank)."
    )
    schedule: Literal[SCHEDULES] = Field("none", description="Pipeline schedule; 'none' when pp == 1.")  # type: ignore[valid-type]
    sequence_parallel: bool = Field(
        False, description="Shard norms/dropout over the TP group (needs tp > 1)."
    )
    recompute: Literal[RECOMPUTE] = Field("none", description="Activation recomputation.")  # type: ignore[valid-type]
    virtual_stages: int = Field(
        1, ge=1, le=1024, description="Stages per pipeline rank (interleaved/V schedules)."
    )

    @model_validator(mode="after")
    def _check_layout(self) -> LayoutSpec:
        try:
            self.to_layout()
        except LayoutError as e:
            raise ValueError(str(e).replace("layout.", "parallelism.")) from e
        return self

    def to_layout(self) -> Layout:
        return Layout(**self.model_dump())


def _parallelism_kind(value: Any) -> str:
    return "auto" if isinstance(value, str) else "layout"


ParallelismField = Annotated[
    Annotated[Literal["auto"], Tag("auto")] | Annotated[LayoutSpec, Tag("layout")],
    Discriminator(
        _parallelism_kind,
        custom_error_type="parallelism_kind",
        custom_error_message="parallelism must be 'auto' or a layout object",
    ),
]


# ---- resources and policies -------------------------------------------------------------------
class ResourcesSpec(_Strict):
    gpus: int | None = Field(
        None, ge=1, le=_MAX_DEGREE, description="GPUs to use; unset = what the plan wants."
    )
    gpu_type: str | None = Field(
        None, min_length=1, max_length=64, description="GPU type; unset = the cluster's."
    )


class CheckpointPolicy(_Strict):
    every_steps: int = Field(
        0, ge=0, le=_MAX_COUNT, description="Checkpoint period in steps; 0 = only at the end."
    )
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept per job.")
    async_save: bool = Field(
        False, description="Write checkpoints in the background while training continues."
    )


class FaultTolerancePolicy(_Strict):
    max_restarts: int = Field(3, ge=0, le=1000, description="Restarts before the job is failed.")
    heartbeat_timeout_s: float | None = Field(
        None, gt=0, le=86_400, description="A rank silent this long is hung; unset = the service default."
    )
    sdc_check_every: int = Field(
        1, ge=0, le=_MAX_COUNT, description="Replica fingerprint check period; 0 = off."
    )


FaultKind = Literal["kill_rank", "kill_node", "hang_rank", "slow_rank", "bitflip", "corrupt_checkpoint"]


class FaultSpec(BaseModel):
    """A fault to inject (acted on only when the service has fault injection enabled)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    kind: FaultKind = Field(description="What to break.")
    at_step: int = Field(ge=0, le=_MAX_COUNT, description="Step at which the fault fires.")
    rank: int | None = Field(None, ge=0, le=_MAX_DEGREE, description="Target rank (rank faults).")
    node: str | None = Field(None, min_length=1, max_length=128, description="Target node (node faults).")


# ---- the job ----------------------------------------------------------------------------------
DEMO_SPEC: dict[str, Any] = {
    "name": "demo",
    "priority": 0,
    "model": {"preset": "demo"},
    "data": {"kind": "synthetic", "seed": 0},
    "train": {"steps": 30, "global_batch": 8, "lr": 0.003, "seed": 0},
    "parallelism": "auto",
    "resources": {"gpus": 8},
    "checkpoint": {"every_steps": 10, "keep": 2},
    "fault_tolerance": {"max_restarts": 3},
}
EXPLICIT_SPEC: dict[str, Any] = {
    "name": "tiny-explicit",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "micro_batch_size": 1, "num_microbatches": 2},
    "faults": [{"kind": "kill_rank", "at_step": 5, "rank": 1}],
}


class JobSpec(_Strict):
    """Everything Lattice needs to run one training job."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [DEMO_SPEC, EXPLICIT_SPEC]}
    )

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=_NAME_PATTERN,
        description="Human-readable job name (letters, digits, '.', '_', '-', space).",
        examples=["demo"],
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; ties go to the older job.")
    model: ModelField = Field(description="A preset ({preset: NAME}) or an explicit model shape.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    train: TrainConfig = Field(description="Optimisation settings.")
    parallelism: ParallelismField = Field(
        "auto", description="'auto' lets the planner choose the layout, or an explicit layout."
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="GPU request.")
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy, description="Checkpoint policy.")
    fault_tolerance: FaultTolerancePolicy = Field(
        default_factory=FaultTolerancePolicy, description="Restart and detection policy."
    )
    faults: list[FaultSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Faults to inject (testing; needs fault injection on).",
    )

    @model_validator(mode="before")
    @classmethod
    def _storable_strings(cls, data: Any) -> Any:
        # PostgreSQL text/JSONB cannot hold NUL or NaN; lone surrogates cannot be encoded at all.
        _check_storable(data, "")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if isinstance(self.model, ModelPreset):
            self.model_spec()  # an unknown preset is a validation error naming model.preset
        if isinstance(self.parallelism, LayoutSpec):
            layout = self.parallelism.to_layout()
            if layout.global_batch != self.train.global_batch:
                raise ValueError(
                    f"parallelism: dp ({layout.dp}) x micro_batch_size ({layout.micro_batch_size}) x "
                    f"num_microbatches ({layout.num_microbatches}) = {layout.global_batch} must equal "
                    f"train.global_batch ({self.train.global_batch})"
                )
            try:
                check_layout_for_model(self.model_spec(), layout)  # what the ranks would refuse later
            except LayoutError as e:
                raise ValueError(f"parallelism: {e}") from e
            if self.resources.gpus is not None and layout.world_size != self.resources.gpus:
                raise ValueError(
                    f"parallelism: tp x cp x dp x pp = {layout.world_size} must equal resources.gpus "
                    f"({self.resources.gpus})"
                )
        return self

    @field_validator("faults")
    @classmethod
    def _fault_targets(cls, faults: list[FaultSpec]) -> list[FaultSpec]:
        for i, fault in enumerate(faults):
            if fault.kind in ("kill_rank", "hang_rank", "slow_rank", "bitflip") and fault.rank is None:
                raise ValueError(f"faults[{i}].rank is required for kind {fault.kind!r}")
            try:  # the controller's own validation, so a bad parameter is a 422 and not a failed start
                normalize_fault(fault.model_dump(exclude_none=True), f"faults[{i}]")
            except FaultError as e:
                raise ValueError(str(e)) from e
        return faults

    # ---- conversions ----------------------------------------------------------------------------
    def model_spec(self) -> ModelSpec:
        """The model shape, resolving a preset through the planner (ValueError names model.preset)."""
        if isinstance(self.model, ModelConfig):
            return self.model.to_model_spec()
        from service.planner import PlannerError, get_preset

        try:
            return get_preset(self.model.preset)
        except (PlannerError, KeyError, ValueError) as e:
            message = _message(e)
            raise ValueError(
                message if message.startswith("model.preset") else f"model.preset: {message}"
            ) from e

    def explicit_layout(self) -> Layout | None:
        return self.parallelism.to_layout() if isinstance(self.parallelism, LayoutSpec) else None

    def to_run_config(self, layout: Layout, checkpoint_dir: str | None) -> RunConfig:
        """What each rank's training loop needs, for the layout the job was placed with."""
        return RunConfig(
            model=self.model_spec(),
            layout=layout,
            steps=self.train.steps,
            seed=self.train.seed,
            optim=OptimConfig(
                lr=self.train.lr, weight_decay=self.train.weight_decay, grad_clip=self.train.grad_clip
            ),
            data=DataConfig(kind=self.data.kind, path=self.data.path, seed=self.data.seed),
            checkpoint=CheckpointConfig(
                dir=checkpoint_dir,
                every_steps=self.checkpoint.every_steps,
                keep=self.checkpoint.keep,
                async_save=self.checkpoint.async_save,
            ),
            integrity=IntegrityConfig(fingerprint_every=self.fault_tolerance.sdc_check_every),
            dp_impl=self.train.dp_impl,
        )

    def canonical(self) -> dict[str, Any]:
        """The normalised spec as stored (defaults filled in); equal specs give equal dicts."""
        return self.model_dump(mode="json")


def _message(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _check_storable(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path or 'value'} must be a finite number, got {value}")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{path or 'value'} must not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path or 'value'} must be valid UTF-8 text") from e
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key, path)
            _check_storable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_storable(item, f"{path}[{i}]")


# ---- public views ---------------------------------------------------------------------------------
class RankPlacementPublic(BaseModel):
    """Where one rank runs, as its actor reported it."""

    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    node_id: str = Field(description="Ray node id of the node the rank runs on.")
    node_name: str | None = Field(None, description="The node's name (its `node_name` label), e.g. r1-n2.")
    rack: str
    gpu: int = Field(description="GPU index on the node (-1 if Ray did not assign an index).")


class Progress(BaseModel):
    step: int = Field(description="Last completed optimizer step.")
    total_steps: int = Field(description="Steps the job will run.")
    loss: float | None = Field(None, description="Training loss at the last step.")
    tokens_per_s: float | None = Field(None, description="Training throughput.")
    mfu: float | None = Field(None, description="Measured model FLOPs utilisation.")


class JobPublic(BaseModel):
    id: str = Field(
        description="Job id (a ULID, sortable by creation time).", examples=["01JABCDEF0123456789ABCDEFG"]
    )
    tenant: str
    name: str
    state: JobStateName
    priority: int
    attempt: int = Field(description="Restarts so far.")
    version: int = Field(description="Bumped by every state change (compare-and-set).")
    spec: dict[str, Any] = Field(description="The normalised JobSpec.")
    plan: dict[str, Any] | None = Field(description="The planner's Plan (layout and its evidence).")
    progress: Progress
    result: dict[str, Any] | None = Field(description="Outputs of a finished job, e.g. the model digest.")
    placement: list[RankPlacementPublic] | None = Field(
        None, description="Where each rank runs, read back from the rank actors; null before the ranks start."
    )
    error: str | None
    created_at: dt.datetime
    updated_at: dt.datetime
    started_at: dt.datetime | None
    finished_at: dt.datetime | None

    @classmethod
    def from_row(cls, job: Job) -> JobPublic:
        return cls(
            id=job.id,
            tenant=job.tenant,
            name=job.name,
            state=job.state,
            priority=job.priority,  # type: ignore[arg-type]
            attempt=job.attempt,
            version=job.version,
            spec=job.spec,
            plan=job.plan,
            progress=Progress(
                step=job.step,
                total_steps=job.total_steps,
                loss=job.loss,
                tokens_per_s=job.tokens_per_s,
                mfu=job.mfu,
            ),
            result=job.result,
            placement=[RankPlacementPublic.model_validate(r) for r in job.placement or []] or None,
            error=job.error,
            created_at=job.created_at,
            updated_at=job.updated_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
        )


class JobPage(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last page.")


class EventPublic(BaseModel):
    seq: int = Field(description="Position in the job's event log (1, 2, ...).")
    type: str = Field(
        description="created, state, progress, checkpoint, fault, plan, ...", examples=["state"]
    )
    time: dt.datetime
    payload: dict[str, Any]

    @classmethod
    def from_row(cls, event: JobEvent) -> EventPublic:
        return cls(seq=event.seq, type=event.type, time=event.time, payload=event.payload)


class EventPage(BaseModel):
    items: list[EventPublic]
    next_after: int | None = Field(
        description="Pass as `after` for the next page; null when there is no more."
    )


class TokenCreate(_Strict):
    tenant: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Tenant the token acts for (created if new).",
        examples=["team-a"],
    )
    admin: bool = Field(False, description="Admin tokens see every tenant and may create tokens.")
    description: str | None = Field(
        None, max_length=200, pattern=r"^[^\x00]*$", description="Free-text label."
    )


class TokenCreated(BaseModel):
    token: str = Field(description="The bearer token; shown only now, only its hash is stored.")
    tenant: str
    role: Literal["admin", "user"]


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the offending field, e.g. `model.hidden`.")
    message: str = Field(description="What is wrong and what is allowed.")
    location: Literal["body", "query", "path", "header", "cookie"] = "body"


class Problem(BaseModel):
    """An RFC 9457 problem document (media type application/problem+json)."""

    type: str = Field("about:blank", description="URI of the problem type.")
    title: str = Field(description="Short summary of the problem type.")
    status: int = Field(description="HTTP status code.")
    detail: str = Field(description="What went wrong, naming the field and what is allowed.")
    instance: str | None = Field(None, description="The request path.")
    errors: list[FieldError] | None = Field(None, description="Per-field validation errors.")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready"]
    database: Literal["ok"]
    migration: str | None = Field(description="The database's schema revision (equal to the head).")
