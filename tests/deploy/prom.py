"""A real Prometheus server for tests: scrapes the given targets every second on loopback.

Reusable by any test that needs to see Lattice's metrics through Prometheus (the deploy tests here,
and an end-to-end test that points it at a real `lattice serve`):

    server = start_prometheus(["127.0.0.1:8000"], tmp_path)
    try:
        wait_for_value(server.url, 'lattice_job_step{job_id="j1"}', lambda v: v > 0)
    finally:
        server.stop()
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SCRAPE_JOB = "lattice-api"
"""The scrape job name the deploy config (deploy/prometheus/prometheus.yml) gives the API."""


class PrometheusError(RuntimeError):
    """Prometheus could not be started, or answered a query with an error."""


def find_binary(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/bin") / name, Path("/usr/local/bin") / name) if p.exists()), None
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PromServer:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _stopped: bool = field(default=False, repr=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_prometheus(
    targets: list[str],
    tmp_path: Path,
    *,
    job_name: str = SCRAPE_JOB,
    scrape_interval: str = "1s",
    rule_files: list[Path] | None = None,
    job_options: dict[str, object] | None = None,
    startup_timeout_s: float = 30.0,
) -> PromServer:
    """Start `prometheus` on a free loopback port with a fresh config and TSDB under `tmp_path`.

    `targets` are host:port pairs serving /metrics, all in one scrape job named `job_name`;
    `job_options` are added to that job (e.g. the `authorization` block of the deploy config).
    Returns once the server answers /-/ready; raises PrometheusError otherwise.
    """
    binary = find_binary("prometheus")
    if binary is None:
        raise PrometheusError("the `prometheus` binary is not installed (Debian package `prometheus`)")
    port = free_port()
    workdir = Path(tmp_path) / f"prometheus-{port}"
    (workdir / "data").mkdir(parents=True)
    config: dict[str, object] = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
        },
        "scrape_configs": [
            {
                "job_name": job_name,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": list(targets)}],
                **(job_options or {}),
            }
        ],
    }
    if rule_files:
        config["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = workdir / "prometheus.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            env={**os.environ},
        )
    server = PromServer(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise PrometheusError(f"prometheus exited with {process.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    server.stop()
    raise PrometheusError(f"prometheus not ready after {startup_timeout_s}s:\n{server.log()}")


def query(url: str, expr: str, *, at: float | None = None) -> list[dict]:
    """Run an instant PromQL query; return `data.result`. Raises PrometheusError on a rejected query."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    request = urllib.request.Request(
        f"{url}/api/v1/query",
        data=urllib.parse.urlencode(params).encode(),
        method="POST",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        raise PrometheusError(f"query {expr!r} rejected ({e.code}): {detail}") from e
    if body.get("status") != "success":
        raise PrometheusError(f"query {expr!r} failed: {body}")
    result = body["data"]["result"]
    # Scalars and strings come back as [time, value]; normalise them to one vector sample.
    if body["data"]["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": result}]
    return result


def values(url: str, expr: str) -> list[float]:
    """The sample values of an instant query (one per series)."""
    return [float(sample["value"][1]) for sample in query(url, expr)]


def wait_for_value(
    url: str, expr: str, predicate: Callable[[float], bool], *, timeout_s: float = 30.0
) -> list[float]:
    """Poll `expr` until it returns at least one series and every value satisfies `predicate`."""
    deadline = time.monotonic() + timeout_s
    last: list[float] = []
    while time.monotonic() < deadline:
        last = values(url, expr)
        if last and all(predicate(v) for v in last):
            return last
        time.sleep(0.25)
    raise AssertionError(f"{expr!r} did not satisfy the condition within {timeout_s}s; last values: {last}")


def wait_until_absent(url: str, expr: str, *, timeout_s: float = 30.0) -> None:
    """Poll `expr` until it returns no series (e.g. after a per-job series was removed and went stale)."""
    deadline = time.monotonic() + timeout_s
    last: list[float] = []
    while time.monotonic() < deadline:
        last = values(url, expr)
        if not last:
            return
        time.sleep(0.25)
    raise AssertionError(f"{expr!r} still returns {last} after {timeout_s}s")
