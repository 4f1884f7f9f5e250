"""`--set key=value` overrides of a job spec (`lattice submit --from JOB --set train.steps=2000`).

Pure: `parse_override` reads one `--set` (a dotted key of spec fields, a value parsed as YAML:
`2000` and `3e-4` are numbers, `true` a bool, `null` nothing, `[1, 2]` a list, anything else a string) and
`apply_overrides` returns a copy of the spec with them applied, in order. Whether the result is a
valid spec is the server's to say (a 422 naming the field); what is refused here is a malformed
`--set` (no `=`, an empty key segment) or a key that walks through a value that is not a mapping.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

from service.cli.yaml_input import YamlInputError, parse_yaml

_SEGMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
# YAML 1.1 (PyYAML) reads `3e-4` as a string; a learning rate written so is a number.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class OverrideError(ValueError):
    """A `--set` that cannot be applied; the message names it and what is allowed."""


def parse_override(item: str) -> tuple[tuple[str, ...], Any]:
    """`train.steps=2000` -> (("train", "steps"), 2000)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise OverrideError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.steps=2000")
    path = tuple(key.split("."))
    bad = [p for p in path if not _SEGMENT.match(p)]
    if bad:
        raise OverrideError(
            f"--set {item!r}: key segment {bad[0]!r} is not a field name (letters, digits, _ and -, "
            "dot-separated, e.g. train.steps)"
        )
    try:
        value = parse_yaml(raw, root="the value") if raw.strip() else None
    except YamlInputError as e:
        raise OverrideError(f"--set {item!r}: {e}") from e
    if isinstance(value, str) and _FLOAT.match(raw.strip()):
        value = float(value)
    return path, value


def apply_overrides(spec: Mapping[str, Any], items: Iterable[str]) -> dict[str, Any]:
    """A deep copy of `spec` with each `--set` applied in order (a later one wins); missing
    mappings on the way are created. The input is never changed."""
    result = copy.deepcopy(dict(spec))
    for item in items:
        path, value = parse_override(item)
        node: dict[str, Any] = result
        for depth, segment in enumerate(path[:-1]):
            child = node.setdefault(segment, {})
            if child is None:
                child = node[segment] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise OverrideError(
                    f"--set {item!r}: {where} is {type(child).__name__} {child!r}, not a mapping; "
                    f"set {where} itself instead"
                )
            node = child
        node[path[-1]] = value
    return result
