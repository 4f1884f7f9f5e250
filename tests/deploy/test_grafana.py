"""Grafana: the provisioning files and the three dashboards (jobs, cluster, fault tolerance) fit together."""

from __future__ import annotations

import yaml

from tests.deploy.promql import (
    DASHBOARD_DIR,
    DEPLOY,
    dashboards,
    metric_names_in,
    panels_of,
    variable_queries,
)

PROVISIONING = DEPLOY / "grafana" / "provisioning"


def _datasource() -> dict:
    doc = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (ds,) = doc["datasources"]
    return ds


def _metrics_of(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for panel in panels_of(dashboard["panels"]):
        for target in panel.get("targets", []):
            names |= metric_names_in(target["expr"].replace("$__rate_interval", "1m"))
    return {n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for n in names}


def test_datasource_points_at_the_compose_prometheus() -> None:
    ds = _datasource()
    assert ds["type"] == "prometheus" and ds["access"] == "proxy"
    assert ds["url"] == "http://prometheus:9090"  # service `prometheus` of docker-compose.yml


def test_dashboard_provider_loads_the_dashboard_directory() -> None:
    doc = yaml.safe_load((PROVISIONING / "dashboards" / "lattice.yml").read_text())
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    # docker-compose.yml mounts deploy/grafana/dashboards at this path (test_compose checks the mount).
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


def test_three_dashboards_with_unique_uids_and_the_provisioned_datasource() -> None:
    boards = dashboards()
    assert set(boards) == {"lattice-overview.json", "job-detail.json", "cluster-health.json"}
    assert len({b["uid"] for b in boards.values()}) == 3
    uid = _datasource()["uid"]
    for name, board in boards.items():
        ids = [p["id"] for p in panels_of(board["panels"])]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in panels_of(board["panels"]):
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, f"{name}: panel {panel['title']!r} overflows the grid"
            if panel["type"] == "row":
                continue
            assert panel["targets"], f"{name}: panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == uid, f"{name}: panel {panel['title']!r}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == uid


def test_overview_shows_jobs_queue_gpus_and_health() -> None:
    names = _metrics_of(dashboards()["lattice-overview.json"])
    assert {
        "lattice_jobs",
        "lattice_queue_depth",
        "lattice_queue_wait_seconds",
        "lattice_cluster_gpus_total",
        "lattice_cluster_gpus_free",
        "lattice_node_health",
        "lattice_nodes_quarantined",
    } <= names


def test_job_detail_is_templated_by_job() -> None:
    board = dashboards()["job-detail.json"]
    (var,) = board["templating"]["list"]
    assert var["name"] == "job_id"
    assert (
        "job-detail.json: variable job_id",
        "label_values(lattice_job_step, job_id)",
    ) in variable_queries()
    for panel in panels_of(board["panels"]):
        for target in panel.get("targets", []):
            for name in metric_names_in(target["expr"].replace("$__rate_interval", "1m")):
                # every selector of a per-job metric is scoped to the chosen job
                assert f'{name}{{job_id="$job_id"}}' in target["expr"], f"{panel['title']!r}: {name}"


def test_job_detail_shows_progress_mfu_restarts_recoveries_goodput() -> None:
    board = dashboards()["job-detail.json"]
    names = _metrics_of(board)
    assert {
        "lattice_job_step",
        "lattice_job_loss",
        "lattice_job_tokens_per_second",
        "lattice_job_restarts_total",
        "lattice_job_time_to_recover_seconds",
        "lattice_job_time_to_detect_seconds",
        "lattice_job_steps_lost_total",
        "lattice_job_goodput_ratio",
        "lattice_job_step_seconds",
        "lattice_job_checkpoint_seconds",
        "lattice_job_checkpoint_bytes",
        "lattice_job_sdc_detections_total",
    } <= names
    # MFU against predicted: both in one panel
    assert any(
        {"lattice_job_mfu", "lattice_job_mfu_predicted"} <= _metrics_of({"panels": [p]})
        for p in panels_of(board["panels"])
    )


def test_cluster_health_shows_racks_quarantines_and_faults() -> None:
    board = dashboards()["cluster-health.json"]
    names = _metrics_of(board)
    assert {
        "lattice_node_health",
        "lattice_nodes_quarantined",
        "lattice_cluster_gpus_total",
        "lattice_restarts_total",
        "lattice_sdc_detections_total",
    } <= names
    exprs = [t["expr"] for p in panels_of(board["panels"]) for t in p.get("targets", [])]
    assert any("by (rack, state)" in e for e in exprs), "no nodes-by-rack panel"


def test_no_stray_files_in_dashboard_dir() -> None:
    assert {p.suffix for p in DASHBOARD_DIR.iterdir()} == {".json"}
