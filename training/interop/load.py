"""`model.init_from`: load pretrained weights (a Hugging Face or torch export) into this rank's model
parts, whatever the layout: every parameter takes its slice of the full tensor by canonical name
(`copy_full_into`, as the seeded initialisation does). The optimizer state starts fresh."""

from __future__ import annotations

import torch
from torch import nn

from training.config.run import InitConfig
from training.config.spec import ModelSpec
from training.data.confined import by_descriptor
from training.interop.names import InteropError, canonical_shapes, opened_weights, weights_file


def canonical_weights(init: InitConfig, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The full canonical state dict of the weights `init` names, shapes checked against `spec`."""
    target = weights_file(init.path, init.format)
    with opened_weights(target, init.root) as f:  # checked as opened, not by name (data.confined)
        if init.format == "hf":
            from safetensors.torch import load, load_file

            from training.interop.hf import from_hf

            opened = by_descriptor(f.fileno())  # the same file again, memory-mapped
            state = from_hf(load_file(opened) if opened else load(f.read()), spec)
        else:
            state = torch.load(f, map_location="cpu", weights_only=True)
        if spec.tied_embeddings and "tok_embeddings.weight" in state:
            state["output.weight"] = state["tok_embeddings.weight"]
    for name, shape in canonical_shapes(spec).items():
        if name not in state:
            raise InteropError(f"model.init_from: {target} has no tensor {name!r}")
        if tuple(state[name].shape) != shape:
            raise InteropError(f"model.init_from: tensor {name!r} has shape {list(state[name].shape)}, "
                               f"the model needs {list(shape)}")
    return state


@torch.no_grad()
def load_init_weights(parts: list[nn.Module], init: InitConfig, spec: ModelSpec, ep: int = 1) -> int:
    """Overwrite every parameter of `parts` (possibly sharded) from `init`; returns the count."""
    from training.model.transformer import canonical_name, copy_full_into

    if ep > 1 and spec.is_moe:
        raise InteropError("model.init_from with expert parallelism (ep > 1) is not supported yet; use ep 1")
    state = canonical_weights(init, spec)
    loaded = 0
    for part in parts:
        for name, param in part.named_parameters():
            copy_full_into(param, state[canonical_name(name)])
            loaded += 1
    return loaded
