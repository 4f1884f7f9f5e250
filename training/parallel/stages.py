"""What one rank holds of the model: its pipeline stages (pp > 1) or the whole model, parallelised.

`torch.distributed.pipelining` is imported only for a pipeline: it brings `torch._dynamo`, ~0.7 s of
a core in every rank process that imports it (workers.engine_imports keeps it warm where it matters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from training.config.run import RunConfig
from training.model.transformer import Transformer
from training.parallel.mesh import ParallelDims
from training.parallel.parallelize import parallelize

if TYPE_CHECKING:
    from training.parallel.pipeline import Pipeline


def build_rank_modules(cfg: RunConfig, dims: ParallelDims, device: torch.device
                       ) -> tuple[Pipeline | None, list[nn.Module]]:
    """(the pipeline, or None for pp = 1; this rank's model parts: its stages, or the whole model)."""
    if cfg.layout.pp > 1:
        from training.parallel.pipeline import build_pipeline

        pipeline = build_pipeline(cfg.model, cfg, dims, device)
        return pipeline, list(pipeline.modules)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return None, [parallelize(model, cfg.layout, dims, cfg, device=device)]
