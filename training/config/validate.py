"""What the training engine can run: one pure check (no torch) shared by the engine, the
planner and the API, so that a plan or a submitted layout is never one the ranks refuse later.
"""

from __future__ import annotations

from training.config.layout import Layout, LayoutError
from training.config.spec import ModelSpec

__all__ = ["check_layout_for_model", "LayoutError"]


def check_layout_for_model(spec: ModelSpec, layout: Layout) -> None:
    """Raise LayoutError when this layout cannot split this model."""
    if spec.is_moe and layout.tp > 1:
        raise LayoutError(
            f"layout.tp must be 1 for an MoE model (model.num_experts = {spec.num_experts}), got "
            f"{layout.tp}: experts are split with layout.ep (expert tensor parallel is not implemented)"
        )
    if layout.ep > 1:
        if not spec.is_moe:
            raise LayoutError(f"layout.ep ({layout.ep}) > 1 needs an MoE model (model.num_experts > 0)")
        if spec.num_experts % layout.ep:
            raise LayoutError(f"layout.ep ({layout.ep}) must divide model.num_experts ({spec.num_experts})")
        if layout.zero_stage >= 2:
            raise LayoutError(
                f"layout.zero_stage must be 0 or 1 with layout.ep > 1, got {layout.zero_stage} "
                "(FSDP of expert-parallel weights is not implemented; ZeRO-1 shards their optimizer state)"
            )
    if layout.cp > 1 and spec.seq_len % (2 * layout.cp):
        raise LayoutError(
            f"layout.cp ({layout.cp}): 2 x cp ({2 * layout.cp}) must divide model.seq_len ({spec.seq_len}) "
            "(each CP rank holds two chunks of the sequence, for causal load balance)"
        )
    tp = layout.tp
    if tp > 1:
        for field, value in (("model.heads", spec.heads), ("model.kv_heads", spec.n_kv_heads),
                             ("model.ffn", spec.ffn_dim), ("model.vocab", spec.vocab)):
            if value % tp:
                raise LayoutError(f"layout.tp ({tp}) must divide {field} ({value})")
    if layout.sequence_parallel and (spec.seq_len // layout.cp) % tp:
        what = "model.seq_len" if layout.cp == 1 else "model.seq_len / layout.cp"
        raise LayoutError(
            f"layout.tp ({tp}) must divide {what} ({spec.seq_len // layout.cp}) (sequence_parallel)"
        )
    if layout.pp > 1 and spec.tied_embeddings:
        raise LayoutError("model.tied_embeddings needs pp = 1 (embedding and head are on different stages)")
    if layout.pp > 1 and spec.layers < layout.num_stages:
        raise LayoutError(
            f"model.layers ({spec.layers}) must be >= pp x virtual_stages ({layout.num_stages})"
        )
