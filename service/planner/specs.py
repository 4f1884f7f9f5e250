"""What the planner is asked about: the cluster and the training regime (the model is a ModelSpec)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from service.planner.efficiency import HardwareProfile
from service.planner.errors import PlannerError
from service.planner.hardware import GpuType, get_gpu

# Bytes per parameter by precision regime (Rajbhandari et al. 2020, Sec. 3.1; lecture 14:09):
# (bf16 params, bf16 grads, optimizer state incl. fp32 master weights).
#  - bf16_fp32_adam: fp32 master + fp32 Adam m + fp32 Adam v = 12  -> 2 + 2 + 12 = 16 bytes/param
#  - bf16_fp32_master: fp32 master + bf16 Adam m + bf16 Adam v = 8 -> 2 + 2 + 8 = 12 bytes/param
#  - fp32: fp32 params + fp32 grads + fp32 Adam m and v (no separate master) = 4 + 4 + 8 = 16 bytes/param
PRECISIONS: dict[str, tuple[int, int, int]] = {
    "fp32": (4, 4, 8),
    "bf16_fp32_adam": (2, 2, 12),
    "bf16_fp32_master": (2, 2, 8),
}

ATTENTION_KERNELS = ("flash", "unfused")
# The GPU types that are CPU processes (the embedded cluster): they train in fp32 unless a job asks.
CPU_GPU_TYPES = ("cpu-virtual",)


def default_precision(gpu_type: str) -> str:
    """The precision a job that does not set train.precision trains in: fp32 on the CPU cluster (its
    gloo ranks compute in fp32), bf16_fp32_adam on GPUs (training.parallel.precision)."""
    return "fp32" if get_gpu(gpu_type).name in CPU_GPU_TYPES else "bf16_fp32_adam"
MAX_GPUS = 1 << 20  # a million accelerators; beyond that the search itself is the wrong tool


def _check_int(name: str, value: object, low: int = 1, high: int | None = None) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise PlannerError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class TrainSpec:
    global_batch: int  # sequences per optimizer step
    seq_len: int
    precision: str = "bf16_fp32_adam"
    # The attention kernel: "flash" (fused, causal blocks skipped; what our engine runs through SDPA) or
    # "unfused" (QK^T, softmax and AV as separate kernels: Megatron-LM before FlashAttention, for
    # predicting published runs of that era; docs/planner.md "Efficiency curves").
    attention: str = "flash"
    # ZeRO-1 shadow shards (fault_tolerance.shadow_optimizer, training.parallel.zero): each rank also
    # holds its DP successor's optimizer shard; the engine keeps them in fp32 runs only.
    shadow_optimizer: bool = False

    def __post_init__(self) -> None:
        _check_int("train.global_batch", self.global_batch, 1, 1 << 24)
        _check_int("train.seq_len", self.seq_len, 1, 1 << 24)
        if self.precision not in PRECISIONS:
            raise PlannerError(
                f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.attention not in ATTENTION_KERNELS:
            raise PlannerError(
                f"train.attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}"
            )

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        return PRECISIONS[self.precision]


@dataclass(frozen=True)
class ClusterSpec:
    gpu_type: str
    num_gpus: int
    gpus_per_node: int | None = None  # None = the GPU type's usual node (8 for DGX/HGX)
    nodes_per_rack: int = 4
    oversubscription: float = 1.0  # bandwidth divisor for traffic that leaves a rack
    # The measured profile of this cluster's node type (None: the catalogue's curves); the plan records
    # its node_type and version (Plan.profile).
    profile: HardwareProfile | None = None

    def __post_init__(self) -> None:
        get_gpu(self.gpu_type)  # raises PlannerError naming the known types
        _check_int("cluster.num_gpus", self.num_gpus, 1, MAX_GPUS)
        if self.gpus_per_node is not None:
            _check_int("cluster.gpus_per_node", self.gpus_per_node, 1, 1024)
        _check_int("cluster.nodes_per_rack", self.nodes_per_rack, 1, 1 << 16)
        o = self.oversubscription
        if (
            isinstance(o, bool)
            or not isinstance(o, (int, float))
            or not math.isfinite(o)
            or not 1.0 <= o <= 1000.0
        ):
            raise PlannerError(f"cluster.oversubscription must be a number between 1 and 1000, got {o!r}")
        gpn = self.node_size
        if self.num_gpus > gpn and self.num_gpus % gpn != 0:
            raise PlannerError(
                f"cluster.num_gpus ({self.num_gpus}) must be a multiple of cluster.gpus_per_node ({gpn}) "
                f"or fit in one node"
            )

    @property
    def gpu(self) -> GpuType:
        return get_gpu(self.gpu_type)

    @property
    def node_size(self) -> int:
        """GPUs per node as configured (or the GPU type's default)."""
        return self.gpus_per_node if self.gpus_per_node is not None else self.gpu.gpus_per_node

    @property
    def gpn(self) -> int:
        """GPUs per node actually used: a cluster smaller than a node is one partial node."""
        return min(self.node_size, self.num_gpus)

    @property
    def rack_size(self) -> int:
        return self.gpn * self.nodes_per_rack

    def with_gpus(self, num_gpus: int) -> ClusterSpec:
        return dataclasses.replace(self, num_gpus=num_gpus)
