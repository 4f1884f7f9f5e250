"""`lattice serve --role api --workers N`: several worker processes behind one port. Other roles refuse
the option; a real two-worker server answers, its /metrics sums the counters of both workers, a worker
that dies is replaced without the counters going backwards, and SIGTERM stops them all."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from service import cpus
from service.api.overload import RateLimitMiddleware
from service.cli import app as cli
from service.runtime import Runtime, ServiceStartError, listening_socket, worker_app, worker_share
from service.settings import AUTO_API_WORKERS_MAX, Settings
from tests.api.specs import tiny
from training.parallel.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
GET_COUNTER = re.compile(
    r'^lattice_http_requests_total\{method="GET",route="/v1/jobs/\{job_id\}",status="200"\} ([0-9.]+)$',
    re.MULTILINE,
)


@pytest.mark.parametrize("role", ["all", "scheduler"])
def test_workers_is_refused_for_a_role_that_holds_ray(
    role: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["serve", "--role", role, "--workers", "2"])
    assert result.exit_code == 1
    line = " ".join(result.output.split())
    assert f"--workers 2 needs --role api (role {role} runs one process" in line
    assert not (tmp_path / "lattice.db").exists()  # refused before anything started


def test_the_setting_is_refused_for_the_default_role_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    monkeypatch.setenv("LATTICE_API_WORKERS", "3")
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 1
    assert "LATTICE_API_WORKERS=3 needs --role api" in " ".join(result.output.split())


def test_workers_below_one_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["serve", "--role", "api", "--workers", "0"])
    assert result.exit_code == 2
    assert "--workers" in result.output


def test_the_runtime_refuses_several_workers_outside_role_api(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs role api"):
        Runtime(Settings(home=tmp_path, api_workers=2), role="all")
    assert Runtime(Settings(home=tmp_path, api_workers=2), role="api").workers == 2


def test_auto_runs_one_worker_per_usable_cpu_in_role_api_and_one_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 3)
    settings = Settings(home=tmp_path)
    assert settings.api_workers == "auto"  # the default
    assert settings.api_worker_count("api") == 3
    assert settings.api_worker_count("all") == settings.api_worker_count("scheduler") == 1
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 64)
    assert settings.api_worker_count("api") == AUTO_API_WORKERS_MAX  # past it: more replicas
    assert Settings(home=tmp_path, api_workers=2).api_worker_count("api") == 2  # a number is kept as given
    monkeypatch.setenv("LATTICE_API_WORKERS", "5")
    assert Settings(home=tmp_path).api_workers == 5
    # an embedded Runtime serves in its own process: auto is one worker there
    assert Runtime(Settings(home=tmp_path, api_workers="auto"), role="api").workers == 1


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "max 100000\n"}, None),  # cgroup v2, no limit
    ({"cpu.max": "150000 100000\n"}, 1.5),  # a pod limited to 1.5 CPUs
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
    ({}, None),  # no cgroup files: unknown
])
def test_the_cgroup_cpu_quota_bounds_the_usable_cpus(
    tmp_path: Path, files: dict[str, str], quota: float | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpus.cgroup_cpu_quota(tmp_path) == quota
    mask = len(os.sched_getaffinity(0))
    expected = mask if quota is None else min(mask, math.ceil(quota))
    assert cpus.usable_cpus(tmp_path) == expected


def test_auto_workers_with_the_default_role_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    monkeypatch.setenv("LATTICE_API_WORKERS", "auto")
    monkeypatch.setattr(cpus, "usable_cpus", lambda: 4)
    started: list[Settings] = []

    class _Stop(Exception):
        pass

    def fake_runtime(settings: Settings) -> None:
        started.append(settings)
        raise _Stop

    monkeypatch.setattr("service.runtime.Runtime", fake_runtime)
    umask = os.umask(0o022)  # serve sets its private umask before it starts the runtime: put ours back
    try:
        for role, workers in (("all", 1), ("api", 4)):
            result = CliRunner().invoke(cli, ["serve", "--role", role])
            assert isinstance(result.exception, _Stop), result.output
            assert started[-1].api_workers == workers
    finally:
        os.umask(umask)


def test_each_worker_holds_its_share_of_a_tokens_rate_limit(tmp_path: Path) -> None:
    """A token's limit is the replica's: opening connections that land on other workers cannot multiply it."""
    settings = Settings(home=tmp_path, api_workers=4, rate_limit_per_s=100.0, rate_limit_burst=10)
    share = worker_share(settings)
    assert (share.rate_limit_per_s, share.rate_limit_burst) == (25.0, 3)  # the burst rounded up
    limits = [m.kwargs for m in worker_app(settings).user_middleware if m.cls is RateLimitMiddleware]
    assert limits == [{"rate": 25.0, "burst": 3}]
    single = Settings(home=tmp_path, api_workers=1, rate_limit_per_s=100.0, rate_limit_burst=10)
    assert worker_share(single) is single


def test_the_shared_port_gives_every_connection_tcp_nodelay() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose protocol is IPPROTO_TCP, and an accepted socket
    takes the listener's: without it each response waits for the client's delayed ACK."""
    listener = listening_socket("127.0.0.1", 0)
    assert listener.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_port_in_use_is_a_start_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ServiceStartError, match="cannot listen on 127.0.0.1"):
            listening_socket("127.0.0.1", taken.getsockname()[1])


def _children(pid: int) -> set[int]:
    """Live worker processes of `pid` (spawned by multiprocessing; not its resource tracker), from /proc."""
    kids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in command:
            kids.add(int(entry.name))
    return kids


def _wait_for(check: object, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def two_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env |= {"LATTICE_HOME": str(tmp_path), "LATTICE_LOG_LEVEL": "warning", "TMPDIR": str(tmp_path)}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--role", "api", "--workers", "2",
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200 and len(_children(proc.pid)) == 2
        except httpx.TransportError:
            return False

    try:
        _wait_for(ready, "two API workers")
        yield proc, url, tmp_path
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _gets_counted(url: str) -> float:
    found = GET_COUNTER.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(found.group(1)) if found else 0.0


def test_a_two_worker_api_serves_sums_its_metrics_and_replaces_a_dead_worker(
    two_workers: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    proc, url, home = two_workers
    headers = {"Authorization": f"Bearer {(home / 'token').read_text().strip()}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        submitted = c.post("/v1/jobs", json=tiny())
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]
    gets = 0
    for _ in range(6):  # a new connection each time: the kernel spreads them over the workers
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            assert c.get(f"/v1/jobs/{job_id}").json()["id"] == job_id
            gets += 1
    assert _gets_counted(url) == gets  # every worker's requests, whichever worker answered the scrape
    metrics_dirs = list(home.glob("lattice-prometheus-*"))  # TMPDIR is the home here
    assert len(metrics_dirs) == 1 and any(metrics_dirs[0].iterdir())

    victim = min(_children(proc.pid))
    os.kill(victim, signal.SIGKILL)
    _wait_for(lambda: victim not in _children(proc.pid) and len(_children(proc.pid)) == 2, "a replacement")
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        assert c.get(f"/v1/jobs/{job_id}").status_code == 200
    assert _gets_counted(url) == gets + 1  # the dead worker's counts are kept: no counter reset

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not list(home.glob("lattice-prometheus-*"))  # the next start begins from zero


def test_an_api_worker_puts_its_start_up_heap_out_of_the_collectors_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full cyclic collection holds the GIL, and with it the event loop that sheds load, for as
    long as it scans: after start-up it scans only what requests allocated since (gc.freeze in
    service.runtime.settle_heap), not the imports, the app and its caches."""
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    gc.unfreeze()
    try:
        app = worker_app(Settings())
        assert gc.get_freeze_count() > 10_000  # the imports and the app: tens of thousands of objects
        assert not any(obj is app for obj in gc.get_objects())  # the app is no longer scanned
        fresh = [app]  # allocated after the freeze: tracked as usual
        assert any(obj is fresh for obj in gc.get_objects())
    finally:
        gc.unfreeze()
