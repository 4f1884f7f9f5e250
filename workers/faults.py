"""Fault injection specs: what to break, where and when.

A fault is a dict: `{"kind", "at_step", "rank" | "node", "phase", ...kind parameters}`.

- kill_rank (the rank actor): SIGKILL of its own process.
- hang_rank (the rank actor): blocks before the step's control all-reduce, which the others wait in.
- slow_rank (the rank actor): sleeps `seconds` (default 1.0) every step from then on, a straggler.
- bitflip (the training engine): flips `bit` of element `index` of parameter `name`, on one DP
  replica after the optimizer step (target "param") or in the rank's local gradient before the DP
  reduction (target "grad"); `persistent: true` models a faulty device: the flip recurs each time
  the rank runs that step, so the re-run from the pre-step snapshot reproduces it.
- kill_node (the controller): removes the node (`node`, or the node of `rank`) from the cluster
  through the `NodeKiller` seam (workers.node_killer).
- corrupt_checkpoint (the controller): damages one file (`which`, `mode`) of the first checkpoint
  committed at or after `at_step`.

`phase` is "step" (default: after step `at_step` completes) or "checkpoint" (inside the first
checkpoint save at or after `at_step`; for kill_node: while the controller sees that save open).
Each fault fires once over the job's life. `normalize_fault` validates a spec and fills defaults;
errors name the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FAULT_KINDS = ("kill_rank", "kill_node", "hang_rank", "slow_rank", "bitflip", "corrupt_checkpoint")
RANK_FAULTS = ("kill_rank", "hang_rank", "slow_rank", "bitflip")  # armed on a rank actor
CONTROLLER_FAULTS = ("kill_node", "corrupt_checkpoint")  # carried out by the controller
PHASES = ("step", "checkpoint")
BITFLIP_TARGETS = ("param", "grad", "reduce")  # reduce: DDP's reduced bucket (training.integrity.gradient)
CORRUPT_MODES = ("flip", "truncate", "delete")
DEFAULT_FLIP_PARAM = "layers.0.attention.wq.weight"
DEFAULT_FLIP_BIT = 30  # float32's top exponent bit: x 2^128 when it was 0 (|v| < 2)


class FaultError(ValueError):
    """A fault spec that cannot be injected; the message names the field."""


def _int(spec: Mapping[str, Any], key: str, where: str, low: int, high: int | None = None) -> int:
    value = spec.get(key)
    bad_type = isinstance(value, bool) or not isinstance(value, int)
    if bad_type or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise FaultError(f"{where}.{key} must be an integer {bound}, got {value!r}")
    return value


def normalize_fault(spec: Mapping[str, Any], where: str = "fault") -> dict[str, Any]:
    """A validated copy of `spec` with defaults filled in. Raises FaultError naming the field."""
    if not isinstance(spec, Mapping):
        raise FaultError(f"{where} must be a mapping, got {spec!r}")
    kind = spec.get("kind")
    if kind not in FAULT_KINDS:
        raise FaultError(f"{where}.kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    out = {k: v for k, v in spec.items() if v is not None}
    out["at_step"] = _int(spec, "at_step", where, 0)
    phase = spec.get("phase") or "step"
    if phase not in PHASES:
        raise FaultError(f"{where}.phase must be one of {', '.join(PHASES)}, got {phase!r}")
    out["phase"] = phase
    if kind in RANK_FAULTS:
        out["rank"] = _int(spec, "rank", where, 0)
    elif kind == "kill_node":
        node, rank = spec.get("node"), spec.get("rank")
        if node is None and rank is None:
            raise FaultError(f"{where}: kill_node needs `node` (a node name) or `rank` (that rank's node)")
        if node is not None and (not isinstance(node, str) or not node):
            raise FaultError(f"{where}.node must be a node name, got {node!r}")
        if rank is not None:
            out["rank"] = _int(spec, "rank", where, 0)
    if kind == "slow_rank":
        seconds = spec.get("seconds", 1.0)
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 3600:
            raise FaultError(f"{where}.seconds must be a number in (0, 3600], got {seconds!r}")
        out["seconds"] = float(seconds)
    if kind == "bitflip":
        target = spec.get("target", "param")
        if target not in BITFLIP_TARGETS:
            raise FaultError(f"{where}.target must be one of {', '.join(BITFLIP_TARGETS)}, got {target!r}")
        name = spec.get("name", DEFAULT_FLIP_PARAM)
        if not isinstance(name, str) or not name:
            raise FaultError(f"{where}.name must be a parameter name, got {name!r}")
        persistent = spec.get("persistent", False)
        if not isinstance(persistent, bool):
            raise FaultError(f"{where}.persistent must be true or false, got {persistent!r}")
        out.update(target=target, name=name, index=_int({"index": spec.get("index", 0)}, "index", where, 0),
                   bit=_int({"bit": spec.get("bit", DEFAULT_FLIP_BIT)}, "bit", where, 0, 63),
                   persistent=persistent)
    if kind == "corrupt_checkpoint":
        mode = spec.get("mode", "flip")
        if mode not in CORRUPT_MODES:
            raise FaultError(f"{where}.mode must be one of {', '.join(CORRUPT_MODES)}, got {mode!r}")
        which = spec.get("which", "any")
        if not isinstance(which, str) or not which or ".." in which or which.startswith("/"):
            raise FaultError(
                f"{where}.which must be 'any', 'metadata', 'manifest' or a file name, got {which!r}"
            )
        out.update(mode=mode, which=which)
    return out


def normalize_faults(specs: Any) -> tuple[dict[str, Any], ...]:
    if specs is None:
        return ()
    if not isinstance(specs, list | tuple):
        raise FaultError(f"faults must be a list, got {specs!r}")
    return tuple(normalize_fault(s, f"faults[{i}]") for i, s in enumerate(specs))


def fault_label(fault: Mapping[str, Any]) -> str:
    where = f"node {fault['node']}" if fault.get("node") else f"rank {fault.get('rank')}"
    when = "during the checkpoint save" if fault.get("phase") == "checkpoint" else "after the step"
    return f"{fault['kind']} on {where} at step {fault['at_step']} ({when})"
