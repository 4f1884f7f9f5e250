"""The training side of a job spec: data, optimisation, the parallel layout, resources, checkpoint
and fault-tolerance policies."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from training.config.layout import RECOMPUTE, SCHEDULES, Layout

if TYPE_CHECKING:
    pass
from service.schemas.common import MAX_COUNT, MAX_DEGREE, StrictModel


class ValidationSpec(StrictModel):
    """A held-out split (never trained on) whose loss is reported every `every_steps` steps."""

    path: str | None = Field(
        None, min_length=1, max_length=4096, description="Held-out token file or folder (in the data root)."
    )
    fraction: float | None = Field(
        None, gt=0, lt=1, description="Or: hold out this fraction of the training windows (the last ones)."
    )
    every_steps: int = Field(100, ge=1, le=MAX_COUNT, description="Evaluate every this many steps.")
    batches: int = Field(1, ge=1, le=10_000, description="Global batches of held-out samples per evaluation.")

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSpec:
        if (self.path is None) == (self.fraction is None):
            raise ValueError("data.validation needs exactly one of path or fraction")
        return self


class DataSpec(StrictModel):
    kind: Literal["synthetic", "tokens"] = Field(
        "synthetic",
        description="synthetic: a deterministic task whose loss falls; tokens: a uint16 token file.",
    )
    path: str | None = Field(
        None, min_length=1, max_length=4096, description="Token file or folder of *.bin shards (kind=tokens)."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Data order seed.")
    dtype: Literal["uint16", "uint32"] = Field(
        "uint16", description="Token width of the files: uint16 (nanoGPT's .bin) or uint32."
    )
    validation: ValidationSpec | None = Field(None, description="Held-out validation loss; unset = none.")

    @model_validator(mode="after")
    def _path_for_tokens(self) -> DataSpec:
        if self.kind == "tokens" and not self.path:
            raise ValueError("data.path is required when data.kind is 'tokens'")
        return self


class TrainConfig(StrictModel):
    steps: int = Field(ge=1, le=MAX_COUNT, description="Optimizer steps.")
    global_batch: int = Field(ge=1, le=MAX_COUNT, description="Sequences per optimizer step.")
    lr: float = Field(3e-3, gt=0, le=10, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    grad_clip: float | None = Field(
        None, gt=0, le=1e6, description="Global gradient-norm clip; unset = none."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Initialisation seed.")
    precision: Literal["fp32", "bf16_fp32_adam"] | None = Field(
        None,
        description="fp32, or bf16_fp32_adam (bf16 compute, fp32 master weights and Adam state); unset = the "
        "planner's default for the cluster: fp32 on the CPU cluster (cpu-virtual), bf16_fp32_adam on GPUs.",
    )
    dp_impl: Literal["lattice", "torch"] = Field(
        "lattice", description="Data-parallel implementation at zero_stage 0: Lattice's DDP or torch DDP."
    )
    compile: bool = Field(
        False, description="torch.compile the model (in place: checkpoints and fingerprints keep its names)."
    )


# ---- parallelism ------------------------------------------------------------------------------
class LayoutSpec(StrictModel):
    """A parallel layout: any subset of the fields of training.config.layout.Layout.

    Fields left out (or null) are filled in by the planner (service.planner.fill.plan_layout): when
    Layout's defaults for them already make a layout that runs, those (as always); otherwise the
    fastest layout that keeps every given field. A combination no layout can keep is refused (422,
    `parallelism`) with the reason and the nearest layout that works."""

    tp: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Tensor parallel degree (inside one node).")
    pp: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Pipeline parallel degree.")
    dp: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Data parallel degree.")
    cp: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Context parallel degree.")
    ep: int | None = Field(
        None, ge=1, le=MAX_DEGREE, description="Expert parallel degree (carved out of dp x cp)."
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None, description="ZeRO stage: 0 DDP, 1/2 sharded state, 3 FSDP."
    )
    micro_batch_size: int | None = Field(None, ge=1, le=MAX_DEGREE, description="Sequences per micro-batch.")
    num_microbatches: int | None = Field(
        None, ge=1, le=MAX_DEGREE, description="Micro-batches per step (per DP rank)."
    )
    schedule: Literal[SCHEDULES] | None = Field(  # type: ignore[valid-type]
        None, description="Pipeline schedule; 'none' when pp == 1."
    )
    sequence_parallel: bool | None = Field(
        None, description="Shard norms/dropout over the TP group (needs tp > 1)."
    )
    recompute: Literal[RECOMPUTE] | None = Field(  # type: ignore[valid-type]
        None, description="Activation recomputation."
    )
    virtual_stages: int | None = Field(
        None, ge=1, le=1024, description="Stages per pipeline rank (interleaved/V schedules)."
    )
    dp_replicate: int | None = Field(
        None, ge=1, le=MAX_DEGREE,
        description="ZeRO-2/3: copies of each FSDP shard (HSDP: shard over dp / dp_replicate ranks, "
        "replicate across groups), so a lost rank recovers from a peer without rollback.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        """A layout written as text, e.g. the layout line `lattice plan` prints
        (`tp=2,pp=4,dp=1,zero=1,mbs=1,m=8,schedule=1f1b,sp`): its fields, stored as an object."""
        if not isinstance(data, str):
            return data
        from service.planner import PlannerError
        from service.planner.layout_text import parse_layout_fields

        try:
            return parse_layout_fields(data)
        except PlannerError as e:
            raise ValueError(str(e).replace("layout.", "").replace("layout: ", "")) from e

    def given(self) -> dict[str, Any]:
        """The fields that were given (unset and null ones left out)."""
        return self.model_dump(exclude_none=True)

    def to_layout(self) -> Layout:
        """The given fields with Layout's defaults for the rest (LayoutError when that is no layout)."""
        return Layout(**self.given())


def _parallelism_kind(value: Any) -> str:
    if isinstance(value, str):
        return "auto" if value == "auto" else "line"
    return "layout"


# A layout line: `name=value` (or a bare flag such as `sp`), comma-separated (LayoutSpec._from_text).
LAYOUT_LINE = r"^\s*[A-Za-z_]+\s*(=[^,]*)?(\s*,\s*[A-Za-z_]+\s*(=[^,]*)?)*\s*,?\s*$"


def _layout_line(text: str) -> LayoutSpec:
    # no `=` at all is more likely a misspelt 'auto' than a line of bare flags (only sp is one)
    flags_only = "=" not in text and text.strip() not in ("sp", "sequence_parallel")
    if flags_only or not re.fullmatch(LAYOUT_LINE, text):
        raise ValueError("give 'auto', a layout object or a layout line of comma-separated name=value "
                         "fields, such as 'tp=2,pp=2'")
    return LayoutSpec.model_validate(text)


LayoutLine = Annotated[
    str,
    Field(max_length=512, json_schema_extra={"pattern": LAYOUT_LINE},
          description="The layout line `lattice plan` prints, e.g. 'tp=2,pp=4,dp=1,zero=1,mbs=1,m=8,"
          "schedule=1f1b,sp': its fields, as a layout object."),
    AfterValidator(_layout_line),
]

ParallelismField = Annotated[
    Annotated[Literal["auto"], Tag("auto")] | Annotated[LayoutSpec, Tag("layout")]
    | Annotated[LayoutLine, Tag("line")],
    Discriminator(
        _parallelism_kind,
        custom_error_type="parallelism_kind",
        custom_error_message="parallelism must be 'auto', a layout object or a layout line such as "
        "'tp=2,pp=2'",
    ),
]


# ---- resources and policies -------------------------------------------------------------------
class ResourcesSpec(StrictModel):
    gpus: int | None = Field(
        None, ge=1, le=MAX_DEGREE, description="GPUs to use; unset = what the plan wants."
    )
    gpu_type: str | None = Field(
        None, min_length=1, max_length=64, description="GPU type; unset = the cluster's."
    )


class CheckpointPolicy(StrictModel):
    every_steps: int | None = Field(
        None, ge=0, le=MAX_COUNT, description="Checkpoint period in steps; 0 = only at the end; unset = "
        "Young's optimum from the plan's step time, state size and the cluster's MTBF (plan.checkpoint)."
    )
    keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept per job.")
    async_save: bool = Field(
        False, description="Write checkpoints in the background while training continues."
    )


class PreemptionPolicy(StrictModel):
    grace_s: float = Field(
        120.0, ge=0, le=3600,
        description="How long a preemption notice waits for the checkpoint at the next step boundary; "
        "past it the job stops anyway and resumes from its last verified checkpoint (later steps lost).",
    )
    preemptible: bool = Field(
        True, description="false: never preempted for another job or a node drain (admin only)."
    )


class FaultTolerancePolicy(StrictModel):
    max_restarts: int = Field(3, ge=0, le=1000, description="Restarts before the job is failed.")
    heartbeat_timeout_s: float | None = Field(
        None, gt=0, le=86_400, description="A rank silent this long (or 5 median step times, if longer) is "
        "hung; unset = the service default."
    )
    sdc_check_every: int = Field(
        1, ge=0, le=MAX_COUNT, description="Replica fingerprint check period; 0 = off."
    )
    spares: int | None = Field(
        None, ge=0, le=64, description="Warm spare rank actors kept beside the job on healthy nodes outside "
        "its placement; a lost rank takes one instead of starting cold. Not counted against quotas; "
        "unset = the service default (LATTICE_SPARES_PER_JOB)."
    )
    sdc_abft: bool = Field(
        False, description="Checksum every linear, embedding and norm weight gradient before the DP "
        "reduction (catches sign, exponent and mantissa flips above rounding; ~5-10% of step time on the "
        "CPU bench, falling as the hidden size grows; docs/benchmarks.md)."
    )
    shadow_optimizer: bool = Field(
        False, description="ZeRO-1: each rank also keeps and steps its DP successor's optimizer shard, so "
        "a lost rank comes back from its peers (its shard, parameters and data position) with no step "
        "lost instead of from the checkpoint. Costs 1/DP more optimizer state memory and optimizer step "
        "time per rank; fp32 runs without context or expert parallelism (a spec that gives another "
        "zero_stage, cp or ep > 1, or bf16 is refused); ZeRO-2/3 (FSDP) get peer recovery from "
        "parallelism.dp_replicate > 1 (HSDP) instead (docs/fault_tolerance.md)."
    )
    elastic: bool = Field(
        False, description="Shrink to a smaller DP when capacity is lost and grow back when it returns, "
        "at a checkpoint, the global batch kept (docs/fault_tolerance.md)."
    )
    min_gpus: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Elastic: never shrink below this many GPUs; unset = 1."
    )
    max_gpus: int | None = Field(
        None, ge=1, le=MAX_COUNT, description="Elastic: never grow beyond this many GPUs; unset = the plan's."
    )

    @model_validator(mode="after")
    def _elastic_bounds(self) -> FaultTolerancePolicy:
        if self.min_gpus is not None and self.max_gpus is not None and self.min_gpus > self.max_gpus:
            raise ValueError(f"fault_tolerance.min_gpus: {self.min_gpus} is more than "
                             f"fault_tolerance.max_gpus ({self.max_gpus})")
        return self
