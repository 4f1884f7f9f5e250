"""`JobSpec`: what a user submits. Validation lives here, so every way into Lattice (HTTP, CLI,
tests) refuses the same bad input with the same message, naming the field and what is allowed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import (
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from training.config.layout import Layout, LayoutError
from training.config.run import (
    CheckpointConfig,
    DataConfig,
    InitConfig,
    IntegrityConfig,
    OptimConfig,
    RunConfig,
    ValidationConfig,
    shadow_conflicts,
)
from training.config.spec import ModelSpec
from workers.faults import FaultError, normalize_fault

if TYPE_CHECKING:
    pass
from service.schemas.common import (
    MAX_SPEC_BYTES,
    NAME_PATTERN,
    StrictModel,
    check_json_bounds,
    check_storable,
    error_message,
)
from service.schemas.faults import FaultSpec
from service.schemas.model import ModelConfig, ModelField, ModelPreset
from service.schemas.training import (
    CheckpointPolicy,
    DataSpec,
    FaultTolerancePolicy,
    LayoutSpec,
    ParallelismField,
    PreemptionPolicy,
    ResourcesSpec,
    TrainConfig,
)

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


class JobSpec(StrictModel):
    """Everything Lattice needs to run one training job."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [DEMO_SPEC, EXPLICIT_SPEC]}
    )

    name: str = Field(
        min_length=1,
        max_length=128,
        pattern=NAME_PATTERN,
        description="Human-readable job name (letters, digits, '.', '_', '-', space).",
        examples=["demo"],
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; ties go to the older job.")
    model: ModelField = Field(description="A preset ({preset: NAME}) or an explicit model shape.")
    data: DataSpec = Field(default_factory=DataSpec, description="Training data.")
    train: TrainConfig = Field(description="Optimisation settings.")
    parallelism: ParallelismField = Field(
        "auto", description="'auto' lets the planner choose the layout; or any subset of a layout's fields, "
        "as an object or as the layout line `lattice plan` prints (e.g. 'tp=2,pp=4,dp=1,zero=1,mbs=1,m=8,"
        "schedule=1f1b,sp'); the planner fills in the rest."
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="GPU request.")
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy, description="Checkpoint policy.")
    fault_tolerance: FaultTolerancePolicy = Field(
        default_factory=FaultTolerancePolicy, description="Restart and detection policy."
    )
    preemption: PreemptionPolicy = Field(
        default_factory=PreemptionPolicy,
        description="Preemption notices: grace period, opt-out (docs/fault_tolerance.md).",
        examples=[{"grace_s": 60.0}],
    )
    faults: list[FaultSpec] = Field(
        default_factory=list,
        max_length=100,
        description="Faults to inject (testing; needs an admin token and fault injection on).",
    )
    allow_unfit: bool = Field(
        False, description="Admit a job whose plan does not fit in GPU memory (admin only; for experiments)."
    )

    @model_validator(mode="before")
    @classmethod
    def _storable_strings(cls, data: Any) -> Any:
        # Depth and size first (iteratively): a stored spec must always be servable again.
        check_json_bounds(data, "", max_bytes=MAX_SPEC_BYTES)
        # PostgreSQL text/JSONB cannot hold NUL or NaN; lone surrogates cannot be encoded at all.
        check_storable(data, "")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if isinstance(self.model, ModelPreset):
            self.model_spec()  # an unknown preset is a validation error naming model.preset
        # A (partial) layout is checked against the model and the cluster by the planner when the job
        # is planned (service.planner.fill.plan_layout): a refusal there names the nearest layout.
        self._check_shadow_optimizer()
        return self

    def _check_shadow_optimizer(self) -> None:
        """Shadow shards cover ZeRO-1 fp32 runs without CP or EP (RunConfig.peer_recovery_blocker): a
        spec that rules that out is refused rather than silently run unprotected. Fields left to the
        planner stay open (a plan that picks another ZeRO stage keeps no shadow, and says so)."""
        if not self.fault_tolerance.shadow_optimizer:
            return
        given = self.layout_given() or {}
        conflicts = shadow_conflicts(zero_stage=given.get("zero_stage"), cp=given.get("cp"),
                                     ep=given.get("ep"), precision=self.train.precision)
        wrong = [f"{'train' if k == 'precision' else 'parallelism'}.{k} is {v}" for k, v in conflicts.items()]
        if wrong:
            raise ValueError(
                "fault_tolerance.shadow_optimizer keeps ZeRO-1 optimizer shards of fp32 runs without "
                "context or expert parallelism (parallelism.zero_stage 1, cp 1, ep 1, train.precision "
                f"fp32), but {', '.join(wrong)}"
            )

    @field_validator("faults")
    @classmethod
    def _fault_targets(cls, faults: list[FaultSpec]) -> list[FaultSpec]:
        for i, fault in enumerate(faults):
            if fault.at_step is None:
                fault.at_step = 1  # "the next step" of a job that has not started
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
            message = error_message(e)
            raise ValueError(
                message if message.startswith("model.preset") else f"model.preset: {message}"
            ) from e

    def layout_given(self) -> dict[str, Any] | None:
        """The parallelism fields given (any subset of Layout's); None for `parallelism: auto`."""
        return self.parallelism.given() if isinstance(self.parallelism, LayoutSpec) else None

    def explicit_layout(self) -> Layout | None:
        """The given fields with Layout's defaults for the rest; None for `auto` or when those make no
        Layout (a partial layout). The layout a job runs is its plan's (service.planner.plan_layout)."""
        if not isinstance(self.parallelism, LayoutSpec):
            return None
        try:
            return self.parallelism.to_layout()
        except LayoutError:
            return None

    def to_run_config(self, layout: Layout, checkpoint_dir: str | None,
                      precision: str | None = None, every_steps: int | None = None,
                      data_root: str | None = None) -> RunConfig:
        """What each rank's training loop needs, for the layout the job was placed with and the
        precision its plan used (train.precision, else the plan's default, else fp32); `every_steps`:
        the checkpoint period when the spec leaves it out (service.checkpoint_period); `data_root`:
        the real data root, which every file the ranks read must still be inside when opened."""
        return RunConfig(
            model=self.model_spec(),
            layout=layout,
            steps=self.train.steps,
            seed=self.train.seed,
            optim=OptimConfig(
                lr=self.train.lr, weight_decay=self.train.weight_decay, grad_clip=self.train.grad_clip
            ),
            data=DataConfig(kind=self.data.kind, path=self.data.path, seed=self.data.seed,
                            dtype=self.data.dtype, root=data_root,
                            validation=(ValidationConfig(**self.data.validation.model_dump())
                                        if self.data.validation is not None else None)),
            checkpoint=CheckpointConfig(
                dir=checkpoint_dir,
                every_steps=(self.checkpoint.every_steps if self.checkpoint.every_steps is not None
                             else every_steps or 0),
                keep=self.checkpoint.keep,
                async_save=self.checkpoint.async_save,
            ),
            integrity=IntegrityConfig(fingerprint_every=self.fault_tolerance.sdc_check_every,
                                      abft=self.fault_tolerance.sdc_abft),
            dp_impl=self.train.dp_impl,
            precision=self.train.precision or precision or "fp32",
            compile=self.train.compile,
            shadow_optimizer=self.fault_tolerance.shadow_optimizer,
            init_from=(InitConfig(path=self.model.init_from.path, format=self.model.init_from.format,
                                  root=data_root)
                       if self.model.init_from is not None else None),
        )

    def canonical(self) -> dict[str, Any]:
        """The normalised spec as stored (defaults filled in); equal specs give equal dicts."""
        return self.model_dump(mode="json")
