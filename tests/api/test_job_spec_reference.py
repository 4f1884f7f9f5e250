"""docs/job-spec.md is generated from JobSpec's schema; it must match what the generator writes now."""

from __future__ import annotations

from pathlib import Path

from service.schemas.jobs import JobSpec
from service.schemas.reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "job-spec.md"


def _field_paths(model: type, prefix: str = "") -> set[str]:
    return {f"{prefix}{name}" for name in model.model_fields}  # type: ignore[attr-defined]


def test_checked_in_reference_is_up_to_date() -> None:
    assert DOC.read_text() == render(), (
        "docs/job-spec.md is out of date: run `python -m service.schemas.reference > docs/job-spec.md`"
    )


def test_reference_lists_every_field_with_type_default_limits_and_example() -> None:
    text = render()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    nested = {"train.steps", "train.global_batch", "parallelism.tp", "faults.kind"}
    for path in _field_paths(JobSpec) | nested:
        row = next((r for r in rows if r.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} missing from the reference"
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 6 and all(cells[:5]), row  # field, type, default, limits, example
        assert cells[4] != "-", f"{path} has no example"
    steps = next(r for r in rows if r.startswith("| `train.steps` |"))
    assert "required" in steps and ">= 1" in steps
    assert "| `priority` | integer | `0` | >= -1000, <= 1000 |" in text
