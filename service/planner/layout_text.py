"""Parse a layout written as text, e.g. `tp=8,pp=4,dp=2,zero=1,mbs=1,m=8,schedule=1f1b,sp`.

Accepts Layout's field names and the short names a plan's layout line uses (zero, mbs, m, v, sp),
so that line can be pasted back. Degrees left out are filled in from the cluster and
the batch: dp = gpus / (tp cp pp), num_microbatches = global_batch / (dp mbs), schedule 1f1b when
pp > 1.
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
_INTS = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "micro_batch_size", "num_microbatches", "virtual_stages")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_layout(text: str, *, num_gpus: int | None = None, global_batch: int | None = None) -> Layout:
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
    tp, pp, cp = fields.get("tp", 1), fields.get("pp", 1), fields.get("cp", 1)
    if "dp" not in fields and num_gpus is not None and tp * pp * cp > 0 and num_gpus % (tp * pp * cp) == 0:
        fields["dp"] = num_gpus // (tp * pp * cp)
    mbs = fields.setdefault("micro_batch_size", 1)
    dp = fields.get("dp", 1)
    if (
        "num_microbatches" not in fields
        and global_batch is not None
        and dp * mbs > 0
        and global_batch % (dp * mbs) == 0
    ):
        fields["num_microbatches"] = global_batch // (dp * mbs)
    if pp > 1:
        fields.setdefault("schedule", "1f1b")
    if fields.get("schedule") in (
        "interleaved_1f1b",
        "interleaved_zero_bubble",
        "zbv_zero_bubble",
        "dualpipev",
    ):
        fields.setdefault("virtual_stages", 2)
    try:
        return Layout(**fields)
    except (LayoutError, TypeError) as e:
        raise PlannerError(str(e)) from e
