"""Lattice's planner: choose the parallel layout of a training job and show the evidence.

Pure Python (no torch, no Ray) so that the API, the CLI and the scheduler get answers in
milliseconds. The cost model is specified by ../shared/seed/parallelism-lecture.txt and documented
with its sources and calibration in docs/planner.md.

    from service.planner import plan, get_preset, ClusterSpec, TrainSpec
    p = plan(get_preset("llama3-70b"), TrainSpec(global_batch=512, seq_len=8192), ClusterSpec("H100", 512))
    p.layout, p.to_dict()
"""

from service.planner.efficiency import Efficiency, HardwareProfile
from service.planner.errors import PlannerError
from service.planner.fill import LayoutRefused, layout_gpus, plan_layout
from service.planner.formulas import (
    activation_bytes_per_layer,
    bubble_fraction,
    flops_per_token,
    model_state_bytes,
    param_counts,
    total_params,
    tp_bytes_per_layer,
)
from service.planner.hardware import GPU_CATALOG, GpuType, get_gpu
from service.planner.layout_text import parse_layout
from service.planner.presets import PRESETS, get_preset
from service.planner.result import Plan
from service.planner.search import DEFAULT_SCHEDULES, evaluate, plan
from service.planner.specs import PRECISIONS, ClusterSpec, TrainSpec, default_precision
from training.config.layout import Layout
from training.config.spec import ModelSpec

__all__ = [
    "DEFAULT_SCHEDULES",
    "GPU_CATALOG",
    "PRECISIONS",
    "PRESETS",
    "ClusterSpec",
    "Efficiency",
    "GpuType",
    "HardwareProfile",
    "Layout",
    "LayoutRefused",
    "ModelSpec",
    "Plan",
    "PlannerError",
    "TrainSpec",
    "default_precision",
    "activation_bytes_per_layer",
    "bubble_fraction",
    "evaluate",
    "flops_per_token",
    "get_gpu",
    "get_preset",
    "layout_gpus",
    "model_state_bytes",
    "param_counts",
    "parse_layout",
    "plan",
    "plan_layout",
    "total_params",
    "tp_bytes_per_layer",
]
