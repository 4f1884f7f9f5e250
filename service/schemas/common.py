"""Shared pieces of the API schemas: the strict base model, the bounds every stored number keeps,
and the check that a spec can be stored."""

from __future__ import annotations

import math
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
