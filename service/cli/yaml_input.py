"""YAML a user hands the CLI (a spec file, a `--set` value), read into plain data or refused in one line.

PyYAML's safe loader builds anchors and aliases as shared references: `a: &a [*a]` is a list that
contains itself, and a few nested anchors ("billion laughs") a tree of billions of values once it is
sent as JSON. Both are refused here, with where they are, before anything is sent.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_VALUES = 100_000  # values in the expanded document; a job spec has a few dozen
MAX_DEPTH = 64


class YamlInputError(ValueError):
    """YAML that cannot become a request; the message says where and why."""


def parse_yaml(text: str, root: str = "the document") -> Any:
    """The document in `text` as plain data (dicts, lists, scalars), anchors expanded and bounded;
    errors name a place as a path (`train.steps`, `a[0]`), or `root` for the whole."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise YamlInputError(f"not valid YAML: {' '.join(str(e).split())}") from e
    except RecursionError as e:  # PyYAML composes nested collections recursively
        raise YamlInputError(f"not valid YAML: nested more than {MAX_DEPTH} levels deep") from e
    _check(data, root)
    return data


def _check(data: Any, root: str) -> None:
    count = 0
    stack: list[tuple[Any, str, tuple[int, ...]]] = [(data, "", ())]  # value, where, ids of its parents
    while stack:
        value, where, parents = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise YamlInputError(f"expands to more than {MAX_VALUES:,} values (YAML aliases of aliases?)")
        if not isinstance(value, dict | list):
            continue
        if id(value) in parents:  # never the root: it has no parents
            raise YamlInputError(f"{where} refers to a value that contains it (an alias inside its anchor)")
        if len(parents) >= MAX_DEPTH:
            raise YamlInputError(f"{where or root} is nested more than {MAX_DEPTH} levels deep")
        inner = (*parents, id(value))
        if isinstance(value, dict):
            stack.extend((child, f"{where}.{k}" if where else str(k), inner) for k, child in value.items())
        else:
            stack.extend((child, f"{where}[{i}]", inner) for i, child in enumerate(value))
