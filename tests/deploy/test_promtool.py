"""promtool (Debian package `prometheus`) checks the Prometheus config and alert rules, and runs the
alert rules' unit tests (tests/deploy/alerts_test.yml)."""

from __future__ import annotations

from tests.deploy.promql import ALERTS, PROMETHEUS_CONFIG, alert_rules
from tests.deploy.tools import ROOT, require_binary, run


def test_prometheus_config_is_valid() -> None:
    promtool = require_binary("promtool", "prometheus")
    result = run([promtool, "check", "config", str(PROMETHEUS_CONFIG)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr  # it followed rule_files to alerts.yml


def test_alert_rules_are_valid() -> None:
    promtool = require_binary("promtool", "prometheus")
    result = run([promtool, "check", "rules", str(ALERTS)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_on_their_conditions_only() -> None:
    promtool = require_binary("promtool", "prometheus")
    result = run([promtool, "test", "rules", "tests/deploy/alerts_test.yml"], cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_alert_rules_cover_the_required_alerts() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    # stuck job, restart rate, SDC, quarantine, API error rate
    required = {
        "LatticeJobStuck": "lattice_job_step",
        "LatticeJobHighRestartRate": "lattice_job_restarts_total",
        "LatticeSDCDetected": "lattice_sdc_detections_total",
        "LatticeNodeQuarantined": 'lattice_node_health{state="quarantined"}',
        "LatticeAPIHighErrorRate": 'status=~"5.."',
    }
    for name, fragment in required.items():
        assert name in rules, f"missing alert {name}"
        assert fragment in rules[name]["expr"], f"{name} does not use {fragment}"
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_every_alert_has_a_unit_test() -> None:
    tested = set(
        line.split(":", 1)[1].strip()
        for line in (ROOT / "tests/deploy/alerts_test.yml").read_text().splitlines()
        if line.strip().startswith("alertname:")
    )
    assert {r["alert"] for r in alert_rules()} <= tested
