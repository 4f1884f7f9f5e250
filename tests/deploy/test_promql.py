"""Every PromQL expression of the dashboards and alert rules is valid and names only real metrics.

"Real" means: exposed by service/metrics.py's registry, one of Ray's own metrics listed in
promql.RAY_METRICS (checked against the installed Ray), or a series Prometheus adds itself. So a
renamed metric breaks this test rather than a dashboard.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from service.metrics import REGISTRY, metric_names
from tests.deploy.prom import PromServer, query
from tests.deploy.promql import (
    PROMETHEUS_SERIES,
    RAY_METRICS,
    Expression,
    all_expressions,
    label_values_metric,
    metric_names_in,
    variable_queries,
)

EXPRESSIONS = all_expressions()
KNOWN = metric_names() | RAY_METRICS | PROMETHEUS_SERIES


def _ids(exprs: list[Expression]) -> list[str]:
    return [e.source for e in exprs]


def test_there_are_expressions_to_check() -> None:
    sources = {e.source.split(":")[0] for e in EXPRESSIONS}
    assert {"lattice-overview.json", "job-detail.json", "cluster-health.json", "alerts.yml"} <= sources
    assert len(EXPRESSIONS) > 40


@pytest.mark.parametrize("expr", EXPRESSIONS, ids=_ids(EXPRESSIONS))
def test_prometheus_accepts_the_expression(prometheus: PromServer, expr: Expression) -> None:
    query(prometheus.url, expr.promql)  # raises PrometheusError on a parse or type error


def test_every_referenced_metric_exists() -> None:
    unknown = {}
    for expr in EXPRESSIONS:
        names = metric_names_in(expr.promql)
        assert names, f"{expr.source}: no metric name found in {expr.expr!r}"
        if names - KNOWN:
            unknown[expr.source] = sorted(names - KNOWN)
    for source, q in variable_queries():
        metric, _label = label_values_metric(q)
        if metric not in KNOWN:
            unknown[source] = [metric]
    assert not unknown, f"metrics that neither service/metrics.py nor Ray expose: {unknown}"


def test_variable_queries_name_a_label_of_their_metric(prometheus: PromServer) -> None:
    families = {
        name: collector
        for collector, names in REGISTRY._collector_to_names.items()  # noqa: SLF001
        for name in names
    }
    for source, q in variable_queries():
        metric, label = label_values_metric(q)
        assert label in families[metric]._labelnames, f"{source}: {metric} has no label {label}"  # noqa: SLF001
        # And Prometheus lists values for it, as Grafana's variable query will ask.
        assert query(prometheus.url, f"count by ({label}) ({metric})"), source


def test_metric_name_parser() -> None:
    assert metric_names_in(
        "histogram_quantile(0.95, sum by (le, route) (rate(lattice_http_request_duration_seconds_bucket"
        '{route=~"/v1/.*", method="GET"}[5m])))'
    ) == {"lattice_http_request_duration_seconds_bucket"}
    assert metric_names_in(
        "changes(a_metric[15m]) == 0 and on (job_id) (b_metric offset 15m) unless ignoring(x) c:rule"
    ) == {"a_metric", "b_metric", "c:rule"}
    assert metric_names_in('count(x{state="by"} == 1) or vector(0)') == {"x"}
    assert metric_names_in("sum(rate(x_total[1m])) by (cause) / 1e3 * 1024") == {"x_total"}
    assert metric_names_in('{__name__="y", job="ray"}') == {"y"}
    # A renamed metric is caught: it is parsed, and it is not in the registry.
    assert metric_names_in("lattice_job_stepz") - KNOWN == {"lattice_job_stepz"}


def test_ray_metrics_are_defined_by_the_installed_ray() -> None:
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.origin is not None
    reporter = Path(spec.origin).parent / "dashboard" / "modules" / "reporter" / "reporter_agent.py"
    source = reporter.read_text()
    for name in RAY_METRICS:
        # Ray prefixes its metric names with its namespace "ray_" on export.
        assert re.search(rf'"{name.removeprefix("ray_")}"', source), f"{name} is not defined in {reporter}"


INSTANT = [
    e
    for e in EXPRESSIONS
    if not e.source.startswith("alerts.yml")
    and not re.search(r"\[[^\]]+\]", e.promql)  # range functions need several scrapes
    and not metric_names_in(e.promql) & (RAY_METRICS | PROMETHEUS_SERIES)
]


@pytest.mark.parametrize("expr", INSTANT, ids=_ids(INSTANT))
def test_dashboard_panel_shows_data(prometheus: PromServer, expr: Expression) -> None:
    """With every Lattice metric populated (job "t" active), each instant panel query has a series."""
    assert query(prometheus.url, expr.promql), f"{expr.source}: {expr.promql!r} returned no series"
