"""Bit-flip injection for tests of the integrity checks: flip one bit of a parameter or of a gradient
as autograd produces it, on one rank at one step (once, or every time the step runs)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from training.integrity.fingerprint import INT_OF_SIZE
from training.parallel.wrapping import local_tensor

log = logging.getLogger(__name__)


def flip_bit(tensor: torch.Tensor, flat_index: int, bit: int) -> None:
    """Flip bit `bit` (0 = least significant) of element `flat_index` of `tensor`, in place.

    Works for any floating (or integer) dtype by reading the element's bits as a same-width integer;
    for float32 bits 23..30 are the exponent, 31 the sign.
    """
    words = _words_inplace(tensor)
    nbits = words.element_size() * 8
    if not 0 <= bit < nbits:
        raise ValueError(f"bit must be in [0, {nbits}) for {tensor.dtype}, got {bit}")
    if not 0 <= flat_index < words.numel():
        raise ValueError(f"index must be in [0, {words.numel()}), got {flat_index}")
    mask = (1 << bit) if bit < nbits - 1 or words.dtype == torch.uint8 else -(1 << bit)
    with torch.no_grad():
        words[flat_index] = words[flat_index] ^ mask


def _words_inplace(tensor: torch.Tensor) -> torch.Tensor:
    t = local_tensor(tensor.detach())
    if not t.is_contiguous():
        raise ValueError("flip_bit needs a contiguous tensor")
    return t.view(INT_OF_SIZE[t.element_size()]).view(-1)


@dataclass(frozen=True)
class BitFlip:
    """Flip bit `bit` of element `index` of the parameter (or its gradient) `name` on `rank` at `step`
    (`persistent`: every time the step runs on this rank, re-runs included)."""

    step: int
    rank: int
    target: Literal["param", "grad", "reduce"]  # reduce: the summed gradient in DDP's bucket
    name: str
    index: int
    bit: int
    # A faulty device rather than a one-off upset: the flip happens again each time this process
    # runs the step (a re-run from the pre-step snapshot reproduces it).
    persistent: bool = False

    def __post_init__(self) -> None:
        if self.target not in ("param", "grad", "reduce"):
            raise ValueError(f"BitFlip.target must be 'param', 'grad' or 'reduce', got {self.target!r}")


def _strip_wrappers(name: str) -> str:
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


class BitFlipInjector:
    """Applies the `BitFlip`s meant for this rank. Names match exactly or after dropping wrapper
    prefixes (`module.` of DDP, `_orig_mod.` of torch.compile, ...). Each flip is applied at most once,
    so the methods may be called once per model part.

    A persistent flip applies at every call for its step (call each method once per execution of
    the step then, with every part's parameters).

    Gradient flips, two ways:
    - `maybe_flip_grads` flips `.grad` in place: call it after backward, before the gradients are
      reduced (NaiveDDP/FlatDDP reduce in `finish_gradient_synchronization`; one rank; pipelines).
    - `arm_grad_flips` (call before backward) flips the gradient as autograd produces it, before
      any accumulate-grad hook sees it: needed with the overlapped `DDP` (and torch DDP), which
      reduce gradients during backward, so a flip after backward would be overwritten.
    """

    def __init__(self, flips: Iterable[BitFlip], rank: int) -> None:
        self.rank = rank
        self.flips = [f for f in flips if f.rank == rank]
        self.applied: list[BitFlip] = []
        self._armed: list[tuple[BitFlip, Any]] = []

    def _due(self, step: int, target: str) -> list[BitFlip]:
        armed = {f for f, _ in self._armed}
        return [f for f in self.flips if f.step == step and f.target == target
                and (f.persistent or f not in self.applied) and f not in armed]

    @staticmethod
    def _lookup(name: str, named_params: dict[str, nn.Parameter]) -> nn.Parameter | None:
        if name in named_params:
            return named_params[name]
        clean = _strip_wrappers(name)
        return next((p for n, p in named_params.items() if _strip_wrappers(n) == clean), None)

    def _apply(
        self, step: int, target: str, named_params: Iterable[tuple[str, nn.Parameter]]
    ) -> list[BitFlip]:
        due = self._due(step, target)
        if not due:
            return []
        params = dict(named_params)
        done = []
        for f in due:
            p = self._lookup(f.name, params)
            if p is None:
                continue
            t = p if target == "param" else p.grad
            if t is None:
                log.warning("bit flip %s: parameter %s has no gradient at step %d", f, f.name, step)
                continue
            flip_bit(t, f.index, f.bit)
            log.info("injected %s", f)
            self.applied.append(f)
            done.append(f)
        return done

    def maybe_flip_params(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        return self._apply(step, "param", named_params)

    def maybe_flip_grads(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        return self._apply(step, "grad", named_params)

    def arm_grad_flips(self, step: int, named_params: Iterable[tuple[str, nn.Parameter]]) -> list[BitFlip]:
        """Register one-shot gradient hooks for this step's grad flips (see the class docstring)."""
        for _, handle in self._armed:  # hooks from earlier steps have fired (or are stale): drop them
            handle.remove()
        self._armed = []
        due = self._due(step, "grad")
        params = dict(named_params)
        armed = []
        for f in due:
            p = self._lookup(f.name, params)
            if p is None:
                continue

            def hook(grad: torch.Tensor, f: BitFlip = f) -> torch.Tensor | None:
                if f in self.applied and not f.persistent:
                    return None
                corrupted = grad.clone()
                flip_bit(corrupted, f.index, f.bit)
                log.info("injected %s", f)
                self.applied.append(f)
                return corrupted

            self._armed.append((f, p.register_hook(hook)))
            armed.append(f)
        return armed

    def maybe_flip_reduced(self, step: int, named_views: Iterable[tuple[str, torch.Tensor]]) -> list[BitFlip]:
        """Flip this step's "reduce" targets in DDP's reduced bucket (a parameter's view of it), after
        the reduction and before the average is copied back: corruption in the communication, after
        the local checksum was taken (training.integrity.gradient)."""
        due = self._due(step, "reduce")
        if not due:
            return []
        views = dict(named_views)
        done = []
        for f in due:
            view = self._lookup(f.name, views)  # type: ignore[arg-type]
            if view is None:
                continue
            flip_bit(view, f.index, f.bit)
            log.info("injected %s", f)
            self.applied.append(f)
            done.append(f)
        return done
