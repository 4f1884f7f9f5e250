"""Spec files and `--set` values that YAML can express but a request cannot carry: refused in one
line naming the place, before anything is sent (pure; no server)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from service.cli.client import CliError
from service.cli.jobs import load_spec_file
from service.cli.overrides import OverrideError, parse_override
from service.cli.yaml_input import MAX_DEPTH, MAX_VALUES, YamlInputError, parse_yaml

SPEC = "name: demo\nmodel: {preset: demo}\ntrain: {steps: 5, global_batch: 8}\n"


def _laughs(levels: int) -> str:
    """Anchors of anchors: 10**(levels + 1) values once expanded, a few hundred bytes written."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines)


def test_plain_documents_and_shared_anchors_read_as_data() -> None:
    assert parse_yaml(SPEC)["train"] == {"steps": 5, "global_batch": 8}
    shared = parse_yaml("base: &b {lr: 0.1}\nrun: *b\n")  # an alias that expands to a copy's worth
    assert json.loads(json.dumps(shared)) == {"base": {"lr": 0.1}, "run": {"lr": 0.1}}
    assert len(parse_yaml(_laughs(2))["a2"]) == 10  # 1,110 values: allowed


@pytest.mark.parametrize(("text", "words"), [
    ("a: &a [*a]", "a[0] refers to a value that contains it"),
    ("&a {b: *a}", "b refers to a value that contains it"),
    (_laughs(5), f"more than {MAX_VALUES:,} values"),
    ("a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5), f"more than {MAX_DEPTH} levels"),
    ("a: " + "[" * 5000 + "]" * 5000, f"more than {MAX_DEPTH} levels"),
    ("a: [unclosed", "not valid YAML"),
])
def test_documents_a_request_cannot_carry_are_refused(text: str, words: str) -> None:
    with pytest.raises(YamlInputError, match=re.escape(words)) as info:
        parse_yaml(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "content", "words"), [
    ("spec.yaml", b"name: \xff\xfe demo\n", "is not UTF-8 text"),
    ("spec.yaml", b"a: &a [*a]\n", "spec.yaml: a[0] refers to a value that contains it"),
    ("spec.yaml", _laughs(6).encode(), "values"),
    ("spec.json", ("[" * 100_000 + "]" * 100_000).encode(), "is not valid JSON"),
    ("spec.yaml", b"- 1\n- 2\n", "must contain a job spec mapping"),
])
def test_spec_files_are_refused_in_one_line(tmp_path: Path, name: str, content: bytes, words: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CliError, match=re.escape(words)) as info:
        load_spec_file(path)
    assert "\n" not in str(info.value)


def test_a_good_spec_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    assert load_spec_file(path)["model"] == {"preset": "demo"}


def test_a_set_value_that_contains_itself_is_refused() -> None:
    with pytest.raises(OverrideError, match=re.escape("--set 'train.x=&a [*a]': [0] refers to a value")):
        parse_override("train.x=&a [*a]")
