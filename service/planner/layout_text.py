"""Parse a layout written as text, e.g. `tp=8,pp=4,dp=2,zero=1,mbs=1,m=8,schedule=1f1b,sp`.

Accepts Layout's field names and the short names a plan's layout line uses (zero, mbs, m, v, sp),
so that line can be pasted back. `parse_layout_fields` gives only the fields written (a partial
layout: service.planner.plan_layout fills in the rest, as for a job's `parallelism`).
"""

from __future__ import annotations

from typing import Any

from service.planner.errors import PlannerError
from training.config.layout import Layout, LayoutError

_ALIASES = {
    "zero": "zero_stage",
    "mbs": "micro_batch_size",
    "m": "num_microbatches",
    "v": "virtual_stages",
    "sp": "sequence_parallel",
    "schedule": "schedule",
    "recompute": "recompute",
}
_INTS = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "micro_batch_size", "num_microbatches", "virtual_stages",
         "dp_replicate")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_layout_fields(text: str) -> dict[str, Any]:
    """The fields `text` gives, by Layout's names (a partial layout for plan_layout)."""
    fields: dict[str, Any] = {}
    known = set(Layout.__dataclass_fields__)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, _, value = part.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        value = value.strip()
        if key not in known:
            raise PlannerError(
                f"layout: unknown field {key!r}; allowed: {', '.join(sorted(known | set(_ALIASES)))}"
            )
        if key in fields:  # tp=2,tp=4 (or zero=1,zero_stage=2): which one was meant is not ours to guess
            raise PlannerError(f"layout.{key} is given twice in {text!r}; give it once")
        if key in _INTS:
            try:
                fields[key] = int(value)
            except ValueError:
                raise PlannerError(f"layout.{key} must be an integer, got {value!r}") from None
        elif key == "sequence_parallel":
            if value.lower() not in _TRUE + _FALSE + ("",):
                raise PlannerError(f"layout.sequence_parallel must be on or off, got {value!r}")
            fields[key] = value.lower() in _TRUE or value == ""
        else:
            fields[key] = value
    return fields


def parse_layout(text: str) -> Layout:
    """A whole layout from text (Layout's defaults for fields left out), e.g. a plan's layout line."""
    try:
        return Layout(**parse_layout_fields(text))
    except (LayoutError, TypeError) as e:
        raise PlannerError(str(e)) from e
