"""GPU catalogue lookup for the planner: the catalogue lives in training.config.hardware (shared
with the trainer's MFU metric); this module re-exports it and raises PlannerError for unknown types.
"""

from __future__ import annotations

from service.planner.errors import PlannerError
from training.config.hardware import GPU_CATALOG, GiB, GpuType, find_gpu

__all__ = ["GPU_CATALOG", "GiB", "GpuType", "get_gpu"]


def get_gpu(name: str) -> GpuType:
    """Look a GPU type up by catalog name or alias (case-insensitive)."""
    gpu = find_gpu(name)
    if gpu is None:
        raise PlannerError(f"cluster.gpu_type must be one of {', '.join(GPU_CATALOG)}, got {name!r}")
    return gpu
