"""promtool (Debian package `prometheus`) checks the Prometheus config and alert rules, and runs the
alert rules' unit tests (tests/deploy/alerts_test.yml)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.deploy.promql import ALERTS, PROMETHEUS_CONFIG, alert_rules
from tests.deploy.tools import ROOT, require_binary, run


def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    """promtool also checks that the scrape token file exists: the config is checked in a copy whose
    credentials_file points at a stand-in token (the real one exists only in the compose volume)."""
    promtool = require_binary("promtool", "prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "lattice-api"]
    assert job["authorization"]["type"] == "Bearer"
    token = tmp_path / "token"
    token.write_text("stand-in\n")
    job["authorization"]["credentials_file"] = str(token)
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr  # it followed rule_files to alerts.yml
    syntax = run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS_CONFIG)])
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr


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


def test_every_alert_fires_in_its_unit_test() -> None:
    """Each alert has a case where it fires (per-job alerts: for a job labelled as Lattice exports
    it, job_id, job_name and tenant), not only cases where it stays silent."""
    tests = yaml.safe_load((ROOT / "tests/deploy/alerts_test.yml").read_text())["tests"]
    fired: dict[str, list[dict[str, str]]] = {}
    for case in tests:
        for check in case.get("alert_rule_test", []):
            for alert in check.get("exp_alerts") or []:
                fired.setdefault(check["alertname"], []).append(alert["exp_labels"])
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(rules) <= set(fired), f"alerts never fired in a test: {sorted(set(rules) - set(fired))}"
    for name, rule in rules.items():
        if "lattice_job_" in rule["expr"]:
            assert any({"job_id", "job_name", "tenant"} <= set(labels) for labels in fired[name]), name
