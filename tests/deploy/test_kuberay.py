"""deploy/kuberay/: the RayCluster (racks, GPUs, metrics port), the API Deployment (two `--role api`
replicas) + Service, the scheduler Deployment (two `--role scheduler` replicas), the migration Job
and the PodMonitors fit together and match the image and the settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

from service.settings import Settings
from tests.deploy.tools import ROOT
from workers.topology import RACK_LABEL

KUBERAY = ROOT / "deploy" / "kuberay"
UID = 10001  # the user deploy/Dockerfile creates


def _docs() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


DOCS = _docs()


def _pod_specs() -> Iterator[tuple[str, dict, dict]]:
    """(where, pod metadata, pod spec) of every pod template."""
    cluster = DOCS[("RayCluster", "lattice")]["spec"]
    yield (
        "ray-head",
        cluster["headGroupSpec"]["template"]["metadata"],
        cluster["headGroupSpec"]["template"]["spec"],
    )
    for group in cluster["workerGroupSpecs"]:
        yield group["groupName"], group["template"]["metadata"], group["template"]["spec"]
    lattice_pods = (("Deployment", "lattice-api"), ("Deployment", "lattice-scheduler"),
                    ("Job", "lattice-migrate"))
    for kind, name in lattice_pods:
        template = DOCS[(kind, name)]["spec"]["template"]
        yield name, template.get("metadata", {}), template["spec"]


def test_manifests() -> None:
    assert {
        ("RayCluster", "lattice"),
        ("Deployment", "lattice-api"),
        ("Deployment", "lattice-scheduler"),
        ("Service", "lattice-api"),
        ("Job", "lattice-migrate"),
        ("PersistentVolumeClaim", "lattice-checkpoints"),
        ("PersistentVolumeClaim", "lattice-data"),
        ("PersistentVolumeClaim", "lattice-api-home"),
        ("NetworkPolicy", "lattice-ray"),
        ("PodMonitor", "lattice-api"),
        ("PodMonitor", "lattice-ray"),
    } == set(DOCS)
    assert DOCS[("RayCluster", "lattice")]["apiVersion"] == "ray.io/v1"


def test_worker_groups_are_racks_with_gpus() -> None:
    cluster = DOCS[("RayCluster", "lattice")]["spec"]
    head = cluster["headGroupSpec"]["rayStartParams"]
    assert head["num-gpus"] == "0"
    racks = []
    for group in cluster["workerGroupSpecs"]:
        rack = group["labels"][RACK_LABEL]  # KubeRay passes group labels to `ray start --labels`
        racks.append(rack)
        spec = group["template"]["spec"]
        assert spec["nodeSelector"]["lattice.dev/rack"] == rack  # the pods land in that rack
        assert group["template"]["metadata"]["labels"]["lattice.dev/rack"] == rack
        (container,) = spec["containers"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) > 0
        assert container["resources"]["requests"]["nvidia.com/gpu"] == limits["nvidia.com/gpu"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert sorted(racks) == ["r1", "r2"]


def test_every_ray_node_exports_metrics_on_the_scraped_port() -> None:
    cluster = DOCS[("RayCluster", "lattice")]["spec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        port = group["rayStartParams"]["metrics-export-port"]
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == int(port)
    (endpoint,) = DOCS[("PodMonitor", "lattice-ray")]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    assert DOCS[("PodMonitor", "lattice-ray")]["spec"]["selector"]["matchLabels"] == {
        "ray.io/cluster": "lattice"
    }
    assert {"targetLabel": "job", "replacement": "ray"} in endpoint["relabelings"]


def test_one_image_non_root_matching_the_dockerfile() -> None:
    images = set()
    for where, _meta, spec in _pod_specs():
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] == UID, where
        images |= {c["image"] for c in spec["containers"]}
    assert len(images) == 1
    assert f"--uid {UID}" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_api_deployment_and_service() -> None:
    deployment = DOCS[("Deployment", "lattice-api")]["spec"]
    assert deployment["replicas"] == 2 and deployment["strategy"]["type"] == "RollingUpdate"
    (container,) = deployment["template"]["spec"]["containers"]
    assert container["command"] == ["lattice", "serve", "--role", "api"]
    env = {e["name"]: e for e in container["env"]}
    fields = {f"LATTICE_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields, set(env) - fields
    assert env["LATTICE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "lattice-db", "key": "url"}
    assert "LATTICE_RAY_ADDRESS" not in env  # the API role never touches Ray
    assert env["LATTICE_PORT"]["value"] == "8000"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    service = DOCS[("Service", "lattice-api")]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["selector"].items() <= pod_labels.items()
    (port,) = service["ports"]
    assert port["targetPort"] == "http" and port["port"] == 8000
    monitor = DOCS[("PodMonitor", "lattice-api")]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["podMetricsEndpoints"][0]["port"] == "http"


def test_two_schedulers_drive_ray_on_the_same_database() -> None:
    scheduler = DOCS[("Deployment", "lattice-scheduler")]["spec"]
    assert scheduler["replicas"] == 2
    pod = scheduler["template"]
    assert scheduler["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "scheduler"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["lattice", "serve", "--role", "scheduler"]
    assert not container.get("ports")  # no HTTP
    env = {e["name"]: e for e in container["env"]}
    fields = {f"LATTICE_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields, set(env) - fields
    # KubeRay names the head service <cluster>-head-svc; 6379 is the GCS port of the head
    assert env["LATTICE_RAY_ADDRESS"]["value"] == "lattice-head-svc:6379"
    (api,) = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["spec"]["containers"]
    api_env = {e["name"]: e for e in api["env"]}
    for name in ("LATTICE_DATABASE_URL", "LATTICE_HOME", "LATTICE_CHECKPOINT_ROOT", "LATTICE_DATA_ROOT"):
        assert env[name] == api_env[name], name
    # the Service selects API pods only
    service = DOCS[("Service", "lattice-api")]["spec"]
    assert not service["selector"].items() <= pod["metadata"]["labels"].items()


def test_migration_job_runs_the_migration_script() -> None:
    job = DOCS[("Job", "lattice-migrate")]["spec"]
    assert job["backoffLimit"] >= 1
    spec = job["template"]["spec"]
    assert spec["restartPolicy"] in ("Never", "OnFailure")
    (container,) = spec["containers"]
    (command,) = container["command"]
    assert command == "/app/deploy/migrate.sh"  # the Dockerfile copies the repository to /app
    assert (ROOT / command.removeprefix("/app/")).is_file()
    env = {e["name"]: e for e in container["env"]}
    assert env["LATTICE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "lattice-db"


@pytest.mark.parametrize("where", [w for w, _m, _s in _pod_specs()])
def test_volumes_refer_to_existing_claims(where: str) -> None:
    spec = next(s for w, _m, s in _pod_specs() if w == where)
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for container in spec["containers"]:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{where}: mount {mount['name']} has no volume"
    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in DOCS, f"{where}: no claim {claim}"
            if claim in SHARED_CLAIMS:  # mounted by pods on many nodes
                assert "ReadWriteMany" in DOCS[("PersistentVolumeClaim", claim)]["spec"]["accessModes"]


# ---- exposure and isolation (docs/security.md) ---------------------------------------------------

SHARED_CLAIMS = {"lattice-checkpoints", "lattice-data"}
RAY_POD_LABELS = {"ray.io/cluster": "lattice"}  # KubeRay labels every pod of the RayCluster so


def _api_container() -> dict:
    (container,) = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["spec"]["containers"]
    return container


def _api_env() -> dict[str, str]:
    return {e["name"]: e.get("value") for e in _api_container()["env"]}


def _ray_pods() -> list[tuple[str, dict, dict]]:
    return [(w, m, s) for w, m, s in _pod_specs() if w == "ray-head" or w.startswith("rack-")]


def _backing(spec: dict, container: dict, path: str) -> tuple[dict, dict]:
    """(volume, mount) that serves `path` in the container: the mount with the longest prefix."""
    mounts = [
        m for m in container.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in spec["volumes"]}
    return volumes[mount["name"]], mount


def _claims(spec: dict) -> set[str]:
    volumes = spec.get("volumes", [])
    return {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}


def test_the_api_home_is_on_a_volume_no_ray_pod_mounts() -> None:
    """The admin token (and the server file) live in LATTICE_HOME: a rank reading them could act as
    admin. Each is served by a claim that only Lattice's pods (API, scheduler) mount."""
    env = _api_env()
    spec = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["spec"]
    home = env["LATTICE_HOME"]
    ray_claims = set().union(*(_claims(s) for _w, _m, s in _ray_pods()))
    assert ray_claims == SHARED_CLAIMS
    for state in (f"{home}/token", f"{home}/server", f"{home}/lattice.db"):
        volume, mount = _backing(spec, _api_container(), state)
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claim == "lattice-api-home" and claim not in ray_claims, state
        assert "subPath" not in mount
    # several API and scheduler replicas mount it, on any node
    assert "ReadWriteMany" in DOCS[("PersistentVolumeClaim", "lattice-api-home")]["spec"]["accessModes"]


def test_ray_pods_share_checkpoints_and_read_only_data_at_the_api_paths() -> None:
    env = _api_env()
    api_spec = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["spec"]
    data, checkpoints = env["LATTICE_DATA_ROOT"], env["LATTICE_CHECKPOINT_ROOT"]
    assert data == "/var/lib/lattice/data"
    for path, claim in ((data, "lattice-data"), (checkpoints, "lattice-checkpoints")):
        volume, mount = _backing(api_spec, _api_container(), path)
        assert volume["persistentVolumeClaim"]["claimName"] == claim and mount["mountPath"] == path
    for where, _meta, spec in _ray_pods():
        (container,) = spec["containers"]
        volume, mount = _backing(spec, container, f"{data}/tenant/tokens.bin")
        assert volume["persistentVolumeClaim"] == {"claimName": "lattice-data", "readOnly": True}, where
        assert mount["readOnly"] is True and mount["mountPath"] == data, where
        volume, mount = _backing(spec, container, f"{checkpoints}/job/step_1")
        assert volume["persistentVolumeClaim"]["claimName"] == "lattice-checkpoints", where


def test_the_ray_dashboard_is_not_exposed() -> None:
    cluster = DOCS[("RayCluster", "lattice")]["spec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert "0.0.0.0" not in group["rayStartParams"].values()
        ports = {p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert 8265 not in ports  # no head-service port for the dashboard
    assert cluster["headGroupSpec"]["serviceType"] == "ClusterIP"


def _admits(peer: dict, labels: dict[str, str], same_namespace: bool = True) -> bool:
    if "podSelector" in peer and "namespaceSelector" not in peer:
        return same_namespace and peer["podSelector"]["matchLabels"].items() <= labels.items()
    return False


def test_network_policy_admits_only_ray_and_the_schedulers_to_ray_ports() -> None:
    policy = DOCS[("NetworkPolicy", "lattice-ray")]["spec"]
    assert "Ingress" in policy["policyTypes"]
    assert policy["podSelector"] == {"matchLabels": RAY_POD_LABELS}
    assert DOCS[("RayCluster", "lattice")]["metadata"]["name"] == RAY_POD_LABELS["ray.io/cluster"]
    api_labels = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["metadata"]["labels"]
    scheduler_labels = DOCS[("Deployment", "lattice-scheduler")]["spec"]["template"]["metadata"]["labels"]
    migrate_labels = DOCS[("Job", "lattice-migrate")]["spec"]["template"]["metadata"]["labels"]
    cluster = DOCS[("RayCluster", "lattice")]["spec"]
    ray_labels = {**RAY_POD_LABELS, **cluster["headGroupSpec"]["template"]["metadata"]["labels"]}
    all_ports = [rule for rule in policy["ingress"] if "ports" not in rule]
    peers = [peer for rule in all_ports for peer in rule["from"]]
    # every peer admitted on all ports is a pod selector of this namespace: Ray's or the schedulers'
    assert all(set(peer) == {"podSelector"} for peer in peers)
    assert any(_admits(p, scheduler_labels) for p in peers)
    assert not any(_admits(p, api_labels) for p in peers)  # the API role never talks to Ray
    assert any(_admits(p, ray_labels) for p in peers)
    # not any other pod of Lattice (the migration), not a pod without labels
    assert not any(_admits(p, migrate_labels) for p in peers)
    assert not any(_admits(p, {}) for p in peers)
    # anything else is admitted to the metrics port only
    for rule in policy["ingress"]:
        if "ports" in rule:
            assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == "8080"


def test_metrics_need_the_token_the_pod_monitor_sends() -> None:
    env = _api_env()
    assert env["LATTICE_METRICS_AUTH"] == "true"
    spec = DOCS[("Deployment", "lattice-api")]["spec"]["template"]["spec"]
    token_file = env["LATTICE_METRICS_TOKEN_FILE"]
    volume, mount = _backing(spec, _api_container(), token_file)
    assert mount["readOnly"] is True
    secret = volume["secret"]
    assert secret["defaultMode"] & 0o007 == 0  # not world-readable; fsGroup gives the API the group
    (endpoint,) = DOCS[("PodMonitor", "lattice-api")]["spec"]["podMetricsEndpoints"]
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert credentials["name"] == secret["secretName"]
    assert token_file == f"{mount['mountPath']}/{credentials['key']}"
