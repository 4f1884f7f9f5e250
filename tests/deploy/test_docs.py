"""docs/metrics.md and the README document every metric of service/metrics.py, type and labels."""

from __future__ import annotations

import re

import pytest

from service.metrics import REGISTRY
from tests.deploy.promql import RAY_METRICS
from tests.deploy.tools import ROOT

DOC = ROOT / "docs" / "metrics.md"
README = ROOT / "README.md"


def _table_rows(path=DOC) -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for line in path.read_text().splitlines():
        m = re.fullmatch(r"\| `(lattice_\w+)` \| (\w+) \| ([^|]*) \| [^|]+ \|", line.strip())
        if m:
            labels = set(re.findall(r"`(\w+)`", m.group(3)))
            rows[m.group(1)] = (m.group(2), labels)
    return rows


@pytest.mark.parametrize("path", [DOC, README], ids=["docs", "readme"])
def test_every_metric_is_documented_with_its_type_and_labels(path) -> None:
    rows = _table_rows(path)
    expected = {}
    for collector in REGISTRY._collector_to_names:  # noqa: SLF001
        name = collector._name + ("_total" if collector._type == "counter" else "")  # noqa: SLF001
        expected[name] = (collector._type, set(collector._labelnames))  # noqa: SLF001
    assert rows == expected


def test_ray_metrics_used_by_the_dashboards_are_documented() -> None:
    text = DOC.read_text()
    for name in RAY_METRICS:
        assert f"`{name}`" in text
