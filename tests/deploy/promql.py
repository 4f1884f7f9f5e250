"""PromQL expressions of the deploy configs, and the metric names they reference.

Every dashboard panel query, every Grafana variable query and every alert rule is collected here, so
tests can send each to a real Prometheus and check each metric name against service/metrics.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD_DIR = DEPLOY / "grafana" / "dashboards"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

# Ray's own metrics the dashboards use (docs/metrics.md, "Ray's metrics"). Ray exports them on each
# node's metrics export port with the prefix `ray_`; test_promql checks each is still defined in the
# installed Ray's reporter agent.
RAY_METRICS = frozenset(
    {
        "ray_node_cpu_utilization",
        "ray_node_mem_used",
        "ray_node_mem_total",
        "ray_node_gpus_utilization",
        "ray_node_gram_used",
        "ray_cluster_active_nodes",
    }
)
# Series Prometheus itself attaches to every scrape target.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

# What Grafana substitutes before a query reaches Prometheus; test values that keep the query valid.
GRAFANA_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "job_id": "t",
    "rack": ".*",
}

_FUNCTIONS_AND_KEYWORDS = frozenset(
    {
        # aggregation operators and their modifiers
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "by",
        "without",
        # binary operators and vector matching
        "and",
        "or",
        "unless",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "atan2",
        # modifiers and literals
        "offset",
        "start",
        "end",
        "inf",
        "nan",
    }
)
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<matchers>\{[^}]*\})
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*(?![\w.]))
  | (?P<number>0x[0-9a-fA-F]+|\d*\.?\d+(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<other>\S)
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Expression:
    source: str  # where it comes from, for failure messages: "job-detail.json: panel 'Loss' A"
    expr: str  # as written (with Grafana variables)

    @property
    def promql(self) -> str:
        """The expression as Prometheus receives it, Grafana variables substituted."""
        return substitute_variables(self.expr)


def substitute_variables(expr: str) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in GRAFANA_VARIABLES:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", replace, expr)


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (identifiers that are not functions, keywords or labels)."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    names: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "matchers":
            # {__name__="x"} selects by name too
            names.update(re.findall(r'__name__\s*=\s*"([^"]+)"', text))
        if kind != "ident":
            i += 1
            continue
        lowered = text.lower()
        if lowered in _LABEL_LIST_KEYWORDS and nxt == "(":
            depth, i = 0, i + 1  # skip the parenthesised label list
            while i < len(tokens):
                depth += tokens[i][1] == "("
                depth -= tokens[i][1] == ")"
                i += 1
                if depth == 0:
                    break
            continue
        if nxt == "(" or lowered in _FUNCTIONS_AND_KEYWORDS:
            i += 1
            continue
        names.add(text)
        i += 1
    return names


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def panels_of(panels: list[dict]) -> list[dict]:
    out: list[dict] = []
    for panel in panels:
        out.append(panel)
        out.extend(panels_of(panel.get("panels", [])))  # rows may nest panels
    return out


def dashboard_expressions() -> list[Expression]:
    exprs = []
    for name, dash in dashboards().items():
        for panel in panels_of(dash.get("panels", [])):
            for target in panel.get("targets", []):
                if "expr" in target:
                    exprs.append(
                        Expression(
                            f"{name}: panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
                        )
                    )
    return exprs


def variable_queries() -> list[tuple[str, str]]:
    """(source, Grafana query) of every query-type template variable."""
    out = []
    for name, dash in dashboards().items():
        for var in dash.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                out.append((f"{name}: variable {var['name']}", q))
    return out


def label_values_metric(query: str) -> tuple[str, str]:
    """(metric, label) of a Grafana `label_values(metric, label)` variable query."""
    m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)\s*", query)
    if m is None:
        raise ValueError(f"not a label_values(metric, label) query: {query!r}")
    return m.group(1), m.group(2)


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_expressions() -> list[Expression]:
    return [Expression(f"alerts.yml: {r.get('alert') or r.get('record')}", r["expr"]) for r in alert_rules()]


def all_expressions() -> list[Expression]:
    return dashboard_expressions() + alert_expressions()
