"""Activation recomputation (activation checkpointing), per block (Layout.recompute):

  none       keep every activation.
  selective  recompute the attention branch (norm, QKV, RoPE, attention, output projection) of
             every block in backward and keep the MLP's activations: attention's activations grow
             with the sequence and are cheap to recompute relative to the MLP (Korthikanti et al.
             2022, section 4). Implemented with torch.utils.checkpoint inside the block.
  full       recompute each whole block from its input (one saved tensor per layer).

Recomputation is a flag on each block rather than a checkpoint_wrapper, so parameter names stay
canonical.
"""

from __future__ import annotations

from training.model.transformer import Transformer


def apply_recompute(model: Transformer, mode: str) -> None:
    for block in model.layers.values():
        block.recompute = mode
