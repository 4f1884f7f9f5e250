"""deploy/kuberay/: the RayCluster (racks, GPUs, metrics port), the API Deployment + Service, the
migration Job and the PodMonitors fit together and match the image and the settings."""

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
    for kind, name in (("Deployment", "lattice-api"), ("Job", "lattice-migrate")):
        template = DOCS[(kind, name)]["spec"]["template"]
        yield name, template.get("metadata", {}), template["spec"]


def test_manifests() -> None:
    assert {
        ("RayCluster", "lattice"),
        ("Deployment", "lattice-api"),
        ("Service", "lattice-api"),
        ("Job", "lattice-migrate"),
        ("PersistentVolumeClaim", "lattice-checkpoints"),
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
    assert deployment["replicas"] == 1 and deployment["strategy"]["type"] == "Recreate"
    (container,) = deployment["template"]["spec"]["containers"]
    assert container["command"] == ["lattice", "serve"]
    env = {e["name"]: e for e in container["env"]}
    fields = {f"LATTICE_{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields, set(env) - fields
    assert env["LATTICE_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "lattice-db", "key": "url"}
    # KubeRay names the head service <cluster>-head-svc; 6379 is the GCS port of the head
    assert env["LATTICE_RAY_ADDRESS"]["value"] == "lattice-head-svc:6379"
    assert env["LATTICE_PORT"]["value"] == "8000"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000
    assert container["readinessProbe"]["httpGet"]["path"] == "/metrics"

    service = DOCS[("Service", "lattice-api")]["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["selector"].items() <= pod_labels.items()
    (port,) = service["ports"]
    assert port["targetPort"] == "http" and port["port"] == 8000
    monitor = DOCS[("PodMonitor", "lattice-api")]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["podMetricsEndpoints"][0]["port"] == "http"


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
            assert "ReadWriteMany" in DOCS[("PersistentVolumeClaim", claim)]["spec"]["accessModes"]
