"""Tensor conversion between Lattice's canonical state dict and Hugging Face Llama / Mixtral.

Rotary layout: Lattice rotates interleaved pairs (x[2i], x[2i+1]) of each head (Meta's original
Llama); Hugging Face rotates halves (x[i], x[i + hd/2]) (``rotate_half``). The rows of wq and wk
are permuted per head so both compute the same q·k: HF row ``p * hd/2 + i`` of a head is Lattice
row ``2i + p`` (the ``permute`` of transformers' convert_llama_weights_to_hf.py). wv, wo and
everything else keep their layout. MoE experts are stacked (E, in, out) in Lattice and one
(out, in) Linear per expert in Mixtral.
"""

from __future__ import annotations

import torch

from training.config.spec import ModelSpec
from training.interop.names import EXPERT_HF, InteropError, canonical_shapes, hf_expert_name, hf_name


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads * hd, in) rows of a Lattice q/k projection -> Hugging Face's rotate_half order."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `interleaved_to_halves`."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads_of(name: str, spec: ModelSpec) -> int | None:
    if name.endswith("attention.wq.weight"):
        return spec.heads
    if name.endswith("attention.wk.weight"):
        return spec.n_kv_heads
    return None


def to_hf(state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (contiguous, float32) of a full canonical state dict."""
    out: dict[str, torch.Tensor] = {}
    for name in canonical_shapes(spec):
        if name not in state:
            raise InteropError(f"the checkpoint has no tensor {name!r}")
        t = state[name].detach().to(torch.float32)
        if name.split(".")[-1] in EXPERT_HF:
            for e in range(t.shape[0]):
                out[hf_expert_name(name, e)] = t[e].t().contiguous()  # (out, in)
            continue
        heads = _heads_of(name, spec)
        if heads is not None:
            t = interleaved_to_halves(t, heads)
        out[hf_name(name)] = t.contiguous().clone()
    return out


def from_hf(tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The canonical state dict of Hugging Face tensors (shapes as `canonical_shapes(spec)`)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in canonical_shapes(spec).items():
        if name.split(".")[-1] in EXPERT_HF:
            keys = [hf_expert_name(name, e) for e in range(shape[0])]
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise InteropError(f"the Hugging Face weights have no tensor {missing[0]!r}")
            out[name] = torch.stack([tensors[k].to(torch.float32).t() for k in keys])  # (E, in, out)
            continue
        key = hf_name(name)
        if key not in tensors:
            raise InteropError(f"the Hugging Face weights have no tensor {key!r}")
        t = tensors[key].to(torch.float32)
        heads = _heads_of(name, spec)
        out[name] = halves_to_interleaved(t, heads) if heads is not None else t
    if spec.tied_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
