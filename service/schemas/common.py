"""Shared pieces of the API schemas: the strict base model, the bounds every stored number keeps,
and the check that a spec can be stored."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
)

if TYPE_CHECKING:
    pass


# Database integer columns are 32-bit; keep every stored count well inside.
MAX_COUNT = 1_000_000_000
MAX_DEGREE = 1 << 20
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\- ]*$"

class StrictModel(BaseModel):
    """Unknown fields are errors; NaN/inf are not numbers a job can use."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)



# Caps on the shape of any JSON a request carries (checked before anything else walks it).
MAX_JSON_DEPTH = 8
MAX_JSON_BYTES = 16 * 1024  # one fault, or any other free-form part of a request
MAX_SPEC_BYTES = 64 * 1024  # a whole job spec, as stored


def check_json_bounds(value: Any, path: str, *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int) -> None:
    """Refuse JSON nested deeper than `max_depth` or larger than `max_bytes` serialised, naming the
    field. Iterative, so a hostile depth cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, dict | list) and depth >= max_depth:
            top = re.split(r"[.\[]", where, maxsplit=1)[0] or "body"  # the field a user wrote, first
            raise ValueError(
                f"{top}: nested too deeply (at {where or 'body'}): at most {max_depth} levels of objects "
                "and lists"
            )
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))
    size = len(json.dumps(value, default=str, separators=(",", ":")).encode("utf-8", "replace"))
    if size > max_bytes:
        raise ValueError(f"{path or 'body'} is {size} bytes serialised; at most {max_bytes} are allowed")


def error_message(e: BaseException) -> str:
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def check_storable(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path or 'value'} must be a finite number, got {value}")
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{path or 'value'} must not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{path or 'value'} must be valid UTF-8 text") from e
    elif isinstance(value, dict):
        for key, item in value.items():
            check_storable(key, path)
            check_storable(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_storable(item, f"{path}[{i}]")
