"""What one training run needs, independent of Lattice's service: the model, the layout, the
optimiser, the data and the checkpoint policy. `torchrun -m training.run --spec job.yaml` and
the workers' rank actors both build a `RunConfig` and call `training.train.train`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from training.config.layout import Layout
from training.config.spec import ModelSpec, SpecError

# The precision regimes the engine trains in (service.planner.specs.PRECISIONS has their bytes per param).
ENGINE_PRECISIONS = ("fp32", "bf16_fp32_adam")
# torch.compile backends (training.parallel.compile): inductor generates kernels (a C++ compiler on
# CPU, Triton on CUDA); aot_eager and eager trace without generating code (tests, debugging).
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# Where ZeRO-1 shadow shards apply (training.parallel.zero): ZeRO-1 fp32 runs without CP or EP. The one
# statement of the rule: the engine, the planner's cost model and the job spec all ask `shadow_conflicts`.
SHADOW_NEEDS: dict[str, Any] = {"zero_stage": 1, "precision": "fp32", "cp": 1, "ep": 1}


def shadow_conflicts(**settings: Any) -> dict[str, Any]:
    """The given settings (keys of SHADOW_NEEDS) that rule shadow shards out; None is open."""
    return {k: v for k, v in settings.items() if v is not None and v != SHADOW_NEEDS[k]}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = None


@dataclass(frozen=True)
class ValidationConfig:
    """A held-out split evaluated every `every_steps` steps (training.data.validation)."""

    path: str | None = None  # a separate token file or shard folder (same dtype as the training data)
    fraction: float | None = None  # or: this fraction of the training windows (the last ones), held out
    every_steps: int = 100
    batches: int = 1  # global batches of held-out samples per evaluation (the same samples each time)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.fraction is None):
            raise SpecError("data.validation needs exactly one of path or fraction")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise SpecError(f"data.validation.fraction must be in (0, 1), got {self.fraction}")
        if self.every_steps < 1:
            raise SpecError(f"data.validation.every_steps must be >= 1, got {self.every_steps}")
        if self.batches < 1:
            raise SpecError(f"data.validation.batches must be >= 1, got {self.batches}")


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"  # "synthetic" (deterministic task whose loss falls) or "tokens" (uint16 memmap)
    path: str | None = None  # for kind == "tokens": a token file or a folder of *.bin shards
    seed: int = 0
    dtype: str = "uint16"  # token width: "uint16" (nanoGPT's .bin) or "uint32" (vocabularies > 65,536)
    validation: ValidationConfig | None = None
    root: str | None = None  # set by the service: every file read must be inside (training.data.confined)

    def __post_init__(self) -> None:
        if isinstance(self.validation, dict):  # from a job file or RunConfig.from_dict
            object.__setattr__(self, "validation", ValidationConfig(**self.validation))


@dataclass(frozen=True)
class InitConfig:
    """Start from these weights instead of the seeded initialisation (the optimizer starts fresh)."""

    path: str  # a Hugging Face export folder (model.safetensors) or a torch one (model.pt), or the file
    format: str = "hf"  # "hf" or "torch" (training.interop)
    root: str | None = None  # set by the service: the file read must be inside (training.data.confined)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # None = no checkpoints
    every_steps: int = 0  # 0 = only the final checkpoint (when dir is set)
    keep: int = 3
    async_save: bool = False


@dataclass(frozen=True)
class IntegrityConfig:
    fingerprint_every: int = 1  # compare DP replicas' parameter fingerprints every N steps (0 = off)
    loss_spike_factor: float = 10.0  # a loss this many times the running mean is a spike
    check_finite: bool = True
    # Opt-in: Huang-Abraham checksums of the weight gradients (linear, embedding, norm) before the
    # DP reduction (training.integrity.abft; pp = 1, dp_impl "lattice"; job spec: sdc_abft).
    abft: bool = False


@dataclass(frozen=True)
class RunConfig:
    model: ModelSpec
    layout: Layout
    steps: int
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)
    dp_impl: str = "lattice"  # zero_stage 0: "lattice" (training.parallel.ddp.DDP) or "torch" (torch DDP)
    init_from: InitConfig | None = None  # pretrained weights (model.init_from of the job spec)
    # "fp32" or "bf16_fp32_adam" (bf16 compute, fp32 masters and AdamW state; training.parallel.precision)
    precision: str = "fp32"
    compile: bool = False  # torch.compile the model in place (training.parallel.compile)
    compile_backend: str = "inductor"  # "inductor", or "aot_eager" / "eager" (no code generation)
    # ZeRO-1: each rank also steps its DP successor's optimizer shard (training.parallel.zero, shadow
    # shard), so a lost rank's shard survives on a peer; job spec: fault_tolerance.shadow_optimizer.
    shadow_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise SpecError(f"train.steps must be >= 1, got {self.steps}")
        if self.dp_impl not in ("lattice", "torch"):
            raise SpecError(f"train.dp_impl must be 'lattice' or 'torch', got {self.dp_impl!r}")
        if self.precision not in ENGINE_PRECISIONS:
            raise SpecError(f"train.precision must be one of {', '.join(ENGINE_PRECISIONS)}, "
                            f"got {self.precision!r}")
        if self.compile_backend not in COMPILE_BACKENDS:
            raise SpecError(f"compile_backend must be one of {', '.join(COMPILE_BACKENDS)}, "
                            f"got {self.compile_backend!r}")
        if self.data.kind not in ("synthetic", "tokens"):
            raise SpecError(f"data.kind must be 'synthetic' or 'tokens', got {self.data.kind!r}")
        if self.data.kind == "tokens" and not self.data.path:
            raise SpecError("data.path is required when data.kind is 'tokens'")
        if self.data.dtype not in ("uint16", "uint32"):
            raise SpecError(f"data.dtype must be 'uint16' or 'uint32', got {self.data.dtype!r}")
        if self.init_from is not None and self.init_from.format not in ("hf", "torch"):
            raise SpecError(f"model.init_from.format must be 'hf' or 'torch', got {self.init_from.format!r}")

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

    def peer_recovery_blocker(self) -> str | None:
        """Why a DP peer cannot stand in for a lost rank of this run (None: it can). A peer must hold
        all the rank's state: replicated parameters and optimizer (ZeRO-0, ZeRO-1 with shadow
        shards in fp32 without context parallelism, or ZeRO-2/3 with dp_replicate > 1: HSDP's other
        replicate groups hold the same shards), no expert parallelism, and a replica at all."""
        layout = self.layout
        if layout.dp * layout.cp == 1:
            return "no DP replica (dp x cp = 1)"
        if layout.zero_stage == 1 and self.shadow_optimizer:
            conflicts = shadow_conflicts(precision=self.precision, cp=layout.cp)
            if "precision" in conflicts:
                return f"ZeRO-1 shadow shards cover fp32 runs only, not {self.precision}'s fp32 masters"
            if "cp" in conflicts:
                return "ZeRO-1 shadow shards with context parallelism (cp > 1) are not supported"
        elif layout.zero_stage >= 2 and layout.dp_replicate > 1:
            pass  # HSDP: each dp_replicate group holds every shard (Layout.shard_peers)
        elif layout.zero_stage != 0:
            return (f"ZeRO-{layout.zero_stage} shards the optimizer state: no replica holds a rank's shard"
                    + (" (fault_tolerance.shadow_optimizer keeps one under ZeRO-1)"
                       if layout.zero_stage == 1 else " (layout.dp_replicate > 1 keeps one: HSDP)"))
        if layout.ep != 1:
            return "expert parallelism: DP peers hold other experts"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        d = dict(data)
        optim = dict(d.pop("optim", {}) or {})
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        return cls(
            model=ModelSpec.from_dict(d.pop("model")),
            layout=Layout.from_dict(d.pop("layout")),
            optim=OptimConfig(**optim),
            data=DataConfig(**(d.pop("data", {}) or {})),
            checkpoint=CheckpointConfig(**(d.pop("checkpoint", {}) or {})),
            integrity=IntegrityConfig(**(d.pop("integrity", {}) or {})),
            init_from=InitConfig(**d.pop("init_from")) if d.get("init_from") else None,
            **{k: v for k, v in d.items() if k != "init_from"},
        )
