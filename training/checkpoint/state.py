"""What goes into a checkpoint, keyed by canonical FQN so that any layout can read it.

- model: ``get_model_state_dict`` of each model part (plain tensors, or DTensors under FSDP2 / TP),
  merged; the FQNs of the parts must be distinct (pipeline stages keep the full model's names).
- optimizer: the flattened format of ``get_optimizer_state_dict(..., StateDictOptions(
  flatten_optimizer_state_dict=True))``::

      state.<fqn>.<name>          exp_avg, exp_avg_sq, step, ... of one parameter
      param_groups.<fqn>.<hyper>  lr, betas, weight_decay, ... of the group holding that parameter

  torch's API produces and consumes it for plain, FSDP2 and TP optimizers. The hand-written ZeRO-1
  optimizer (``training.parallel.zero.ShardedOptimizer``: ``.inner`` over the owned parameters,
  ``owned_params()``) is mapped to the same keys here: each rank writes ``state.*`` for the
  parameters it owns (distinct keys across ranks) and ``param_groups.*`` for all of them (identical
  on every rank, DCP keeps one copy); on load it asks for the entries of the parameters it owns
  under its own partition. Plain, ZeRO-1 and FSDP2/TP optimizer states are thus interchangeable.
- RNG: torch CPU (+ CUDA when present), python ``random`` and numpy (when installed), per rank.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (  # _get_fqns: the canonical-FQN rule DSD uses
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from training.parallel.precision import plain_optimizer
from training.parallel.wrapping import unwrap

log = logging.getLogger(__name__)

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

OptimizerArg = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def model_state(parts: Sequence[nn.Module]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for part in parts:
        part_state = get_model_state_dict(unwrap(part))
        clash = state.keys() & part_state.keys()
        if clash:
            raise ValueError(f"model parts share parameter names {sorted(clash)[:3]}; FQNs must be unique")
        state.update(part_state)
    return state


def load_model_state(parts: Sequence[nn.Module], state: dict[str, Any]) -> None:
    """Set each part's parameters and buffers from a merged state (as ``model_state`` returns)."""
    for part in parts:
        module = unwrap(part)
        own = get_model_state_dict(module).keys()
        set_model_state_dict(module, {k: state[k] for k in own})


def is_zero1(optimizer: Any) -> bool:
    return hasattr(optimizer, "inner") and hasattr(optimizer, "owned_params")


def optimizer_pairs(parts: Sequence[nn.Module], optimizer: OptimizerArg) -> list[tuple[nn.Module, Any]]:
    """(model part, its optimizer) pairs: one optimizer per part."""
    if optimizer is None:
        return []
    optims = list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
    if len(optims) != len(parts):
        raise ValueError(
            f"pass one optimizer per model part: got {len(optims)} optimizer(s) for {len(parts)} part(s)"
        )
    # A bf16 run's optimizer steps its masters through the same parameter objects (which hold the
    # fp32 masters while a checkpoint is saved or loaded: training.parallel.precision).
    return [(unwrap(part), plain_optimizer(optim)) for part, optim in zip(parts, optims, strict=True)]


def optimizer_state(pairs: list[tuple[nn.Module, Any]]) -> dict[str, Any]:
    """The flattened FQN-keyed optimizer state of every pair (a template to load into, too)."""
    state: dict[str, Any] = {}
    for part, optim in pairs:
        if is_zero1(optim):
            state.update(_zero1_state(part, optim))
        else:
            state.update(get_optimizer_state_dict(part, optim, options=_OPTIM_OPTIONS))
    return state


def load_optimizer_state(pairs: list[tuple[nn.Module, Any]], state: dict[str, Any]) -> None:
    for part, optim in pairs:
        if is_zero1(optim):
            _set_zero1_state(part, optim, state)
        else:
            set_optimizer_state_dict(part, optim, state, options=_OPTIM_OPTIONS)


# ZeRO-1 (training.parallel.zero.ShardedOptimizer): the same flattened keys as
# get_optimizer_state_dict(flatten_optimizer_state_dict=True) produces for a plain optimizer, i.e.
#   state.<fqn>.<name>          for each parameter this rank owns (owners write distinct keys)
#   param_groups.<fqn>.<hyper>  for every parameter (identical on all ranks; DCP keeps one copy)
# The outer optimizer's groups hold the hyperparameters (it copies them to `.inner` each step).
def _param_fqns(module: nn.Module) -> dict[torch.Tensor, str]:
    """Parameter -> canonical FQN, the names torch's state-dict API uses (wrapper prefixes removed)."""
    fqns = {}
    for name, param in module.named_parameters():
        names = _get_fqns(module, name)
        assert len(names) == 1, f"parameter {name} maps to FQNs {names}"
        fqns[param] = next(iter(names))
    return fqns


@torch.no_grad()
def _init_inner_state(inner: torch.optim.Optimizer) -> None:
    """Materialise an unstepped optimizer's state (a zero-gradient step at lr 0, as torch's
    state-dict API does), keeping any gradients the parameters hold."""
    if inner.state:
        return
    params = [p for g in inner.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in inner.param_groups]
    for g in inner.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    inner.step()
    for g, lr in zip(inner.param_groups, lrs, strict=True):
        if lr is not None:
            g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def _zero1_state(module: nn.Module, zopt: Any) -> dict[str, Any]:
    fqns = _param_fqns(module)
    inner = zopt.inner
    _init_inner_state(inner)
    state: dict[str, Any] = {}
    for outer_group, inner_group in zip(zopt.param_groups, inner.param_groups, strict=True):
        for p in outer_group["params"]:
            for key, value in outer_group.items():
                if key != "params":
                    state[f"param_groups.{fqns[p]}.{key}"] = value
        for p in inner_group["params"]:
            for name, value in inner.state.get(p, {}).items():
                if isinstance(value, dict):
                    raise ValueError(f"nested optimizer state ({name} of {fqns[p]}) is not supported")
                state[f"state.{fqns[p]}.{name}"] = value
    return state


@torch.no_grad()
def _set_zero1_state(module: nn.Module, zopt: Any, loaded: dict[str, Any]) -> None:
    fqns = _param_fqns(module)
    inner = zopt.inner
    for outer_group, inner_group in zip(zopt.param_groups, inner.param_groups, strict=True):
        if outer_group["params"]:
            first = fqns[outer_group["params"][0]]
            for key in list(outer_group):
                if key != "params":
                    outer_group[key] = inner_group[key] = loaded[f"param_groups.{first}.{key}"]
        for p in inner_group["params"]:
            slots = inner.state.get(p, {})
            for name, current in list(slots.items()):
                value = loaded[f"state.{fqns[p]}.{name}"]
                if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                    if value is not current:
                        current.copy_(value)
                else:
                    slots[name] = value


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.tensor(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("CUDA RNG saved for %d devices, %d present: not restored",
                        len(state["cuda"]), torch.cuda.device_count())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            log.warning("checkpoint holds a numpy RNG state but numpy is not installed: not restored")
        else:
            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
