"""`torch.compile` as a per-job opt-in (`train.compile: true`, RunConfig.compile).

Each transformer block is compiled in place (`nn.Module.compile`), not wrapped in an
`OptimizedModule`: parameters, `state_dict()` keys and the module tree stay exactly those of the
eager model (no `_orig_mod.` prefix), so the integrity fingerprints, the model digest, the
checkpoints and the interop exports read the same tensors under the same names whether the job
compiles or not. Per block, as torchtitan does: the blocks share one graph (dynamo inlines the
module and takes its parameters as inputs), so compile time does not grow with depth; the
embedding and the output head stay eager.

`parallelize` compiles after every other technique has been applied (CP, EP, recompute, FSDP,
materialisation) and before the data-parallel wrapper; a pipeline compiles the blocks of each of
its stages. Not with tensor parallel (see `apply_compile`). Dynamo breaks the graph where it must
(FSDP2's hooks, which it skips by default; the CP ring's collectives) and runs those parts eagerly;
recomputation (torch.utils.checkpoint, non-reentrant) is traced as a higher-order op.
"""

from __future__ import annotations

import logging

from torch import nn

from training.config.run import COMPILE_BACKENDS

log = logging.getLogger(__name__)


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    assert isinstance(layers, nn.ModuleDict), f"{type(model).__name__} has no transformer blocks"
    return list(layers.values())


def apply_compile(model: nn.Module, enabled: bool, backend: str = "inductor", tp: int = 1) -> bool:
    """Compile each of `model`'s transformer blocks in place when `enabled` (see the module docstring);
    returns whether it did. With tensor parallel (tp > 1) the model stays eager, with a warning: a
    compiled block's backward receives a plain tensor where the TP redistribution expects a DTensor
    (torch 2.13), so a TP job runs as if it had not asked."""
    if not enabled:
        return False
    if tp > 1:
        log.warning("train.compile ignored: not supported with tensor parallel (tp=%d); training eager", tp)
        return False
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend must be one of {', '.join(COMPILE_BACKENDS)}, got {backend!r}")
    blocks = _blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    log.info("compiled %d blocks with torch.compile (backend %s)", len(blocks), backend)
    return True


def is_compiled(model: nn.Module) -> bool:
    """Has `apply_compile` compiled this model's blocks (in place)?"""
    blocks = _blocks(model)
    return bool(blocks) and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
