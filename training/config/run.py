"""What one training run needs, independent of Lattice's service: the model, the layout, the
optimiser, the data and the checkpoint policy. `torchrun -m training.run --spec job.yaml` and
the workers' rank actors both build a `RunConfig` and call `training.train.train`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from training.config.layout import Layout
from training.config.spec import ModelSpec, SpecError


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = None


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"  # "synthetic" (deterministic task whose loss falls) or "tokens" (uint16 memmap)
    path: str | None = None  # for kind == "tokens": a nanoGPT-style .bin file of uint16 tokens
    seed: int = 0


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

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise SpecError(f"train.steps must be >= 1, got {self.steps}")
        if self.dp_impl not in ("lattice", "torch"):
            raise SpecError(f"train.dp_impl must be 'lattice' or 'torch', got {self.dp_impl!r}")
        if self.data.kind not in ("synthetic", "tokens"):
            raise SpecError(f"data.kind must be 'synthetic' or 'tokens', got {self.data.kind!r}")
        if self.data.kind == "tokens" and not self.data.path:
            raise SpecError("data.path is required when data.kind is 'tokens'")

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

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
            **d,
        )
