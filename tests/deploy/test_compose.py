"""docker-compose.yml: valid for Debian's `docker-compose config` (which validates against the
compose-spec schema it ships), secrets required, services started in dependency order (health
checks, the migration first), every file it references present in the repository, its addresses
consistent with prometheus.yml, and two API replicas (`--role api`) plus two schedulers (`--role
scheduler`) on one PostgreSQL."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import PROMETHEUS_CONFIG
from tests.deploy.tools import ROOT, require_binary, run

COMPOSE = ROOT / "docker-compose.yml"
SECRETS = {"POSTGRES_PASSWORD": "s3cret-pg", "GRAFANA_ADMIN_PASSWORD": "s3cret-gf"}
SERVICES = {
    "postgres",
    "migrate",
    "metrics-token",
    "api",
    "scheduler",
    "ray-head",
    "ray-worker-r1",
    "ray-worker-r2",
    "prometheus",
    "grafana",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("COMPOSE_")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def resolved() -> dict:
    """The compose file as `docker-compose config` resolves it (interpolated, merged, validated)."""
    compose = require_binary("docker-compose", "docker-compose")
    result = run([compose, "-f", str(COMPOSE), "config"], env=_env(**SECRETS))
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.fixture(scope="module")
def raw() -> dict:
    """The compose file as written (YAML merge keys resolved, ${...} left as is)."""
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_config_refuses_to_run_without_a_secret(missing: str) -> None:
    compose = require_binary("docker-compose", "docker-compose")
    env = _env(**{k: v for k, v in SECRETS.items() if k != missing})
    result = run([compose, "-f", str(COMPOSE), "config"], env=env)
    assert result.returncode != 0
    assert f"set {missing}" in result.stderr


def test_services_and_gating(resolved: dict) -> None:
    services = resolved["services"]
    assert set(services) == SERVICES
    assert services["postgres"]["healthcheck"]["test"]
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["command"] == ["/app/deploy/migrate.sh"]
    assert services["migrate"].get("restart", "no") == "no"
    assert services["api"]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["grafana"]["depends_on"].keys() == {"prometheus"}


def test_api_and_schedulers_talk_to_postgres_and_only_the_schedulers_to_ray(resolved: dict) -> None:
    services = resolved["services"]
    env, sched = services["api"]["environment"], services["scheduler"]["environment"]
    password = SECRETS["POSTGRES_PASSWORD"]
    assert env["LATTICE_DATABASE_URL"] == f"postgresql+psycopg://lattice:{password}@postgres:5432/lattice"
    assert services["migrate"]["environment"]["LATTICE_DATABASE_URL"] == env["LATTICE_DATABASE_URL"]
    assert sched["LATTICE_DATABASE_URL"] == env["LATTICE_DATABASE_URL"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD"] == password
    assert "LATTICE_RAY_ADDRESS" not in env  # the API role never touches Ray
    assert sched["LATTICE_RAY_ADDRESS"] == "ray-head:6379"
    assert "--port=6379" in services["ray-head"]["command"]
    assert env["LATTICE_HOST"] == "0.0.0.0" and env["LATTICE_PORT"] == "8000"
    assert _published(services["api"]) == [("0.0.0.0", 8000), ("0.0.0.0", 8001)]  # one port per replica
    for name in ("api", "scheduler"):
        assert env["LATTICE_MIGRATE_ON_START"] == sched["LATTICE_MIGRATE_ON_START"] == "false"
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert services["scheduler"]["depends_on"]["ray-head"] == {"condition": "service_healthy"}


def test_two_api_replicas_and_two_schedulers_by_role(resolved: dict) -> None:
    services = resolved["services"]
    for name, role in (("api", "api"), ("scheduler", "scheduler")):
        command = services[name]["command"]
        assert command[:2] == ["lattice", "serve"] and command[command.index("--role") + 1] == role, name
        assert services[name]["deploy"]["replicas"] == 2, name
    assert not services["scheduler"].get("ports")  # no HTTP: nothing to publish
    assert "healthcheck" in services["api"]
    from typer.testing import CliRunner

    from service.cli import app

    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).stdout
    if "--role" in help_text:  # the flag this file uses (issue 14 item 1)
        assert "scheduler" in help_text


def test_settings_know_every_lattice_variable(resolved: dict) -> None:
    from service.settings import Settings

    fields = {f"LATTICE_{name.upper()}" for name in Settings.model_fields}
    for name, service in resolved["services"].items():
        for var in service.get("environment", {}):
            if (
                var.startswith("LATTICE_") and var != "LATTICE_DB_WAIT_SECONDS"
            ):  # read by deploy/wait_for_db.py
                assert var in fields, f"{name}: {var} is not a field of service.settings.Settings"


def test_two_ray_workers_in_different_racks(resolved: dict) -> None:
    racks = set()
    for name in ("ray-worker-r1", "ray-worker-r2"):
        cmd = resolved["services"][name]["command"]
        assert cmd[:2] == ["ray", "start"] and "--address=ray-head:6379" in cmd and "--block" in cmd
        labels = [a.removeprefix("--labels=") for a in cmd if a.startswith("--labels=")]
        assert len(labels) == 1
        racks.add(dict(kv.split("=") for kv in labels[0].split(","))["rack"])
        assert any(re.fullmatch(r"--num-gpus=\d+", a) for a in cmd), f"{name}: no --num-gpus"
        assert resolved["services"][name]["depends_on"]["ray-head"] == {"condition": "service_healthy"}
    assert racks == {"r1", "r2"}


def test_ray_labels_parse_with_the_installed_ray(resolved: dict) -> None:
    from ray._private.label_utils import parse_node_labels_string

    from workers.topology import NODE_NAME_LABEL, RACK_LABEL

    for name in ("ray-worker-r1", "ray-worker-r2"):
        (arg,) = [a for a in resolved["services"][name]["command"] if a.startswith("--labels=")]
        labels = parse_node_labels_string(arg.removeprefix("--labels="))
        # the labels Lattice's topology reads (workers/topology.py)
        assert labels == {RACK_LABEL: name[-2:], NODE_NAME_LABEL: name}


def test_lattice_services_share_one_image_built_from_the_dockerfile(raw: dict) -> None:
    services = raw["services"]
    built = ("migrate", "metrics-token", "api", "scheduler", "ray-head", "ray-worker-r1", "ray-worker-r2")
    images = {services[n]["image"] for n in built}
    assert len(images) == 1
    for name in built:
        build = services[name]["build"]
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
        assert "TORCH_VARIANT" in build["args"]


def test_every_referenced_file_exists(resolved: dict) -> None:
    checked = 0
    for name, service in resolved["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, str):
                source = volume.split(":")[0]
                kind = "bind" if source.startswith((".", "/")) else "volume"
            else:
                source, kind = volume["source"], volume["type"]
            if kind == "bind":
                assert Path(source).exists(), f"{name}: bind mount source {source} is missing"
                checked += 1
    assert checked >= 3  # prometheus config, grafana provisioning, grafana dashboards
    # the command of the one-off migration is part of the image (copied from the repository)
    assert (ROOT / "deploy" / "migrate.sh").is_file()


def test_mounts_match_what_prometheus_and_grafana_read(raw: dict) -> None:
    prometheus = raw["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    grafana = raw["services"]["grafana"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy/grafana/dashboards" / Path(home).name).is_file()


def test_prometheus_targets_are_compose_services(resolved: dict) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {
        job["job_name"]: [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        for job in config["scrape_configs"]
    }
    (api,) = [j for j in config["scrape_configs"] if j["job_name"] == "lattice-api"]
    # every replica of the `api` service, by DNS (one A record per replica)
    assert api["dns_sd_configs"] == [{"names": ["api"], "type": "A", "port": 8000, "refresh_interval": "15s"}]
    assert jobs["lattice-api"] == []
    ray_nodes = {n for n in resolved["services"] if n.startswith("ray-")}
    assert {t.split(":")[0] for t in jobs["ray"]} == ray_nodes
    for target in jobs["ray"]:
        host, port = target.split(":")
        assert f"--metrics-export-port={port}" in resolved["services"][host]["command"], target


# ---- exposure: what is published, who reaches Ray, who mounts what (docs/security.md) -------------

RAY_PORTS = {6379, 8265, 10001, 8080}  # GCS, dashboard (Jobs API), Ray client, metrics export
LOOPBACK = {"127.0.0.1", "::1"}


def _published(service: dict) -> list[tuple[str, int]]:
    """(host address, published port) of every port mapping, in any syntax docker-compose prints."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            if port.get("published") is not None:  # a port or a range ("8000-8001": one per replica)
                first, _, last = str(port["published"]).partition("-")
                for number in range(int(first), int(last or first) + 1):
                    out.append((port.get("host_ip") or "0.0.0.0", number))
            continue
        parts = str(port).split("/")[0].rsplit(":", 2)
        if len(parts) == 3:
            out.append((parts[0].strip("[]") or "0.0.0.0", int(parts[1])))
        elif len(parts) == 2:
            out.append(("0.0.0.0", int(parts[0])))
    return out


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """Container path -> (source volume or path, read-only) of every mount."""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            out[target] = (source, "ro" in mode)
        else:
            out[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return out


def test_published_port_parser() -> None:
    assert _published({"ports": ["127.0.0.1:3000:3000/tcp", "8000:8000", {"published": 9, "target": 9}]}) == [
        ("127.0.0.1", 3000),
        ("0.0.0.0", 8000),
        ("0.0.0.0", 9),
    ]
    mapping = {"published": 1, "target": 1, "host_ip": "127.0.0.1"}
    assert _published({"ports": [mapping]}) == [("127.0.0.1", 1)]
    assert _published({"ports": [{"published": "8000-8002", "target": 8000}]}) == [
        ("0.0.0.0", 8000), ("0.0.0.0", 8001), ("0.0.0.0", 8002)]


def test_only_the_api_is_published_beyond_loopback(resolved: dict) -> None:
    exposed = {
        (name, port)
        for name, service in resolved["services"].items()
        for host, port in _published(service)
        if host not in LOOPBACK
    }
    assert exposed == {("api", 8000), ("api", 8001)}
    published = {(n, p) for n, s in resolved["services"].items() for _h, p in _published(s)}
    # Prometheus (lifecycle API) and Grafana are reachable from the host's loopback
    assert {("prometheus", 9090), ("grafana", 3000)} <= published
    for name, service in resolved["services"].items():
        if name.startswith("ray-"):
            assert _published(service) == [], f"{name} publishes {service['ports']}"
        assert not {p for _h, p in _published(service)} & RAY_PORTS, name


def test_the_ray_dashboard_listens_on_loopback_inside_its_container(resolved: dict) -> None:
    command = resolved["services"]["ray-head"]["command"]
    assert "--dashboard-host=127.0.0.1" in command
    for name, service in resolved["services"].items():
        if name.startswith("ray-"):
            assert not [a for a in service["command"] if "0.0.0.0" in a], name


def test_only_the_schedulers_and_prometheus_share_a_network_with_ray(resolved: dict) -> None:
    networks = {name: set(s.get("networks") or {"default"}) for name, s in resolved["services"].items()}
    ray_nodes = {n for n in networks if n.startswith("ray-")}
    for name in ray_nodes:
        assert networks[name] == {"ray"}, name
    on_ray = {n for n, nets in networks.items() if "ray" in nets}
    assert on_ray == ray_nodes | {"scheduler", "prometheus"}  # the API replicas never talk to Ray
    assert resolved["services"]["metrics-token"]["network_mode"] == "none"  # it only writes a file


def test_probe_is_readiness(resolved: dict) -> None:
    test = " ".join(resolved["services"]["api"]["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/readyz" in test and "/metrics" not in test


def test_ray_nodes_mount_checkpoints_and_data_not_the_api_home(resolved: dict) -> None:
    env = resolved["services"]["api"]["environment"]
    api_mounts = _mounts(resolved["services"]["api"])
    home_volume = api_mounts[env["LATTICE_HOME"]][0]
    checkpoints, data = env["LATTICE_CHECKPOINT_ROOT"], env["LATTICE_DATA_ROOT"]
    assert data == "/var/lib/lattice/data"
    assert api_mounts[data] == ("data", False) and api_mounts[checkpoints] == ("checkpoints", False)
    assert _mounts(resolved["services"]["scheduler"]) == {k: v for k, v in api_mounts.items()
                                                           if k != "/run/lattice-metrics"}
    for name, service in resolved["services"].items():
        if not name.startswith("ray-"):
            continue
        mounts = _mounts(service)
        assert home_volume not in {source for source, _ro in mounts.values()}, name
        # the same volumes at the same paths as the API (ranks open the paths the API hands them)
        assert mounts == {checkpoints: ("checkpoints", False), data: ("data", True)}, name


def test_metrics_need_the_token_prometheus_sends(resolved: dict) -> None:
    services = resolved["services"]
    env = services["api"]["environment"]
    assert env["LATTICE_METRICS_AUTH"] == "true"
    token_file = Path(env["LATTICE_METRICS_TOKEN_FILE"])
    api_mounts, prom_mounts = _mounts(services["api"]), _mounts(services["prometheus"])
    assert api_mounts[str(token_file.parent)] == ("metrics-token", True)
    assert prom_mounts[str(token_file.parent)] == ("metrics-token", True)
    # the one-off service writes that file before the API and Prometheus start
    writer = services["metrics-token"]
    assert writer["command"][-1] == str(token_file)
    assert _mounts(writer)[str(token_file.parent)] == ("metrics-token", False)
    for name in ("api", "prometheus"):
        condition = services[name]["depends_on"]["metrics-token"]
        assert condition == {"condition": "service_completed_successfully"}
    # Prometheus sends the same file; it reads it through the lattice group (the file is 0640)
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "lattice-api"]
    assert job["authorization"] == {"type": "Bearer", "credentials_file": str(token_file)}
    assert services["prometheus"]["user"].split(":")[1] == "10001"
    assert "--gid 10001" in (ROOT / "deploy" / "Dockerfile").read_text()
