"""`lattice cluster up|down|status`: the shared embedded cluster's address file and process record
(workers.shared_cluster), and a role finding the address when LATTICE_RAY_ADDRESS is unset."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from workers.shared_cluster import (
    SharedClusterState,
    clear_state,
    live_address,
    process_start_time,
    read_address,
    read_state,
    stop,
    write_state,
)

REPO = Path(__file__).resolve().parents[2]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_address_file_is_private_and_a_live_record_is_joined(tmp_path: Path) -> None:
    proc = _sleeper()
    try:
        started = process_start_time(proc.pid)
        assert started is not None
        state = SharedClusterState(address="127.0.0.1:6380", temp_dir="/tmp/x",
                                   processes=[(proc.pid, started)], gpus=16, nodes=4)
        write_state(tmp_path, state)
        assert stat.S_IMODE((tmp_path / "ray_address").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "ray_cluster.json").stat().st_mode) == 0o600
        assert read_address(tmp_path) == "127.0.0.1:6380"
        assert read_state(tmp_path) == state
        assert live_address(tmp_path) == "127.0.0.1:6380"
        # A recorded pid whose start time differs is another process (pid reuse): the record is stale.
        write_state(tmp_path, SharedClusterState("127.0.0.1:6380", "/tmp/x", [(proc.pid, started + 1)]))
        assert live_address(tmp_path) is None
        write_state(tmp_path, state)
        assert stop(tmp_path, grace_s=5) == 1
        assert proc.wait(10) != 0  # signalled
        assert read_address(tmp_path) is None and read_state(tmp_path) is None
        assert live_address(tmp_path) is None
    finally:
        proc.kill()
        proc.wait()


def test_stop_never_signals_a_process_it_did_not_start(tmp_path: Path) -> None:
    proc = _sleeper()
    try:
        started = process_start_time(proc.pid)
        assert started is not None
        write_state(tmp_path, SharedClusterState("127.0.0.1:1", "/tmp/x", [(proc.pid, started - 1)]))
        assert stop(tmp_path, grace_s=0.1) == 0
        assert proc.poll() is None  # still running
        assert not (tmp_path / "ray_address").exists()
    finally:
        proc.kill()
        proc.wait()


def test_runtime_joins_the_shared_cluster_when_no_address_is_set(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.cluster
    from service.runtime import Runtime
    from service.settings import Settings

    joined: list[str] = []
    monkeypatch.setattr(workers.cluster, "connect", lambda address, **kw: joined.append(address))
    monkeypatch.setattr(workers.cluster, "start_embedded_cluster", lambda **kw: pytest.fail("started one"))
    (tmp_path / "ray_address").write_text("127.0.0.1:6390\n")  # a record without a process list
    Runtime(Settings(home=tmp_path))._start_ray()  # noqa: SLF001
    assert joined == ["127.0.0.1:6390"]
    Runtime(Settings(home=tmp_path, ray_address="10.0.0.1:6379"))._start_ray()  # noqa: SLF001
    assert joined[-1] == "10.0.0.1:6379"  # LATTICE_RAY_ADDRESS wins
    clear_state(tmp_path)


def test_cluster_status_says_whether_the_shared_cluster_is_up(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli.cluster import shared_cluster_line

    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    assert "not running" in shared_cluster_line()
    write_state(tmp_path, SharedClusterState("127.0.0.1:6380", "/tmp/x", [(os.getpid(), process_start_time(
        os.getpid()) or 0)], gpus=16, nodes=4))
    assert shared_cluster_line() == "embedded cluster: up at 127.0.0.1:6380, 16 virtual GPUs on 4 nodes"
    write_state(tmp_path, SharedClusterState("127.0.0.1:6380", "/tmp/x", [(os.getpid(), 1)]))
    assert "stale" in shared_cluster_line()
    clear_state(tmp_path)
    result = CliRunner().invoke(app, ["cluster", "down"], env={"LATTICE_HOME": str(tmp_path)})
    assert result.exit_code == 0 and "nothing was running" in result.stdout


@pytest.mark.slow
def test_cluster_up_status_down_with_real_ray(tmp_path: Path) -> None:
    """The real thing in subprocesses: `up` returns with the cluster still running, a driver joins it
    from the address file, `down` stops every process it started."""
    home = tmp_path / "h"
    env = {**os.environ, "LATTICE_HOME": str(home)}
    env.pop("LATTICE_RAY_ADDRESS", None)
    lattice = [sys.executable, "-m", "service"]
    size = ["--racks", "1", "--nodes-per-rack", "2", "--gpus-per-node", "2"]
    up = subprocess.run([*lattice, "cluster", "up", *size], env=env, cwd=REPO, capture_output=True, text=True,
                        timeout=180)
    try:
        assert up.returncode == 0, up.stderr
        state = read_state(home)
        assert state is not None and live_address(home) == state.address
        probe = ("import ray, sys; from workers.cluster import connect; connect(sys.argv[1]); "
                 "print(int(ray.cluster_resources().get('GPU', 0)))")
        gpus = subprocess.run([sys.executable, "-c", probe, state.address], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert gpus.stdout.strip().splitlines()[-1] == "4", gpus.stderr
    finally:
        down = subprocess.run([*lattice, "cluster", "down"], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert down.returncode == 0 and "stopped" in down.stdout, down.stderr
    assert read_address(home) is None
    assert all(process_start_time(pid) != started for pid, started in state.processes)
