"""`lattice cluster status`: what GET /v1/cluster carries (the elected scheduler, the hardware profile
of each node type) as tables that fit 80 columns, `-o json` as the API's JSON, and the shared embedded
cluster's line whether or not one is up (and whether or not a server answers)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from service.cli.client import Client, CliError
from tests.cli.test_habits import CLUSTER, StubServer, run
from workers.shared_cluster import SharedClusterState, clear_state, process_start_time, write_state

SCHEDULER = {"leader": "sched-host:4242", "since": "2026-12-01T20:52:06Z", "term": 3}
PROFILES = [
    {"node_type": "H100-80GB", "version": 3, "created_at": "2026-12-01T20:00:00", "compute_dtype": "bf16",
     "matmul_tflops": {"fp32": 48.0, "bf16": 690.0}, "memory_gbps": 3900.0, "backend": "nccl",
     "all_reduce": {"gbps": 350.0, "latency_us": 12.0}},
    {"node_type": "cpu-virtual", "version": 1, "created_at": "2026-12-01T21:00:00", "compute_dtype": "fp32",
     "matmul_tflops": {"fp32": 0.0123}, "memory_gbps": 8.5, "backend": ""},
]  # fmt: skip


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> StubServer:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))  # no shared embedded cluster recorded there
    stub = StubServer()
    monkeypatch.setattr(Client, "resolve", classmethod(lambda cls, settings, **kw: stub))
    view = CLUSTER | {"scheduler": SCHEDULER, "profiles": PROFILES}
    monkeypatch.setattr("tests.cli.test_habits.CLUSTER", view)
    return stub


def test_status_shows_the_leader_and_the_profiles_in_80_columns(server: StubServer) -> None:
    shown = run("cluster", "status")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0] == "embedded cluster: not running (lattice cluster up starts one)"
    assert "scheduler: leader sched-host:4242, term 3, since 2026-12-01T20:52:06Z" in lines
    assert all(len(line) <= 80 for line in lines) and "…" not in shown.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("NODE TYPE"))
    for name in ("VERSION", "DTYPE", "MATMUL", "MEMORY GB/S", "ALL-REDUCE"):
        assert name in lines[header]
    h100 = " ".join(lines[header + 1].split())
    assert h100.startswith("H100-80GB v3 bf16 fp32 48, bf16 690 3900 350 GB/s + 12 us"), h100
    cpu = " ".join(lines[header + 2].split())
    assert cpu == "cpu-virtual v1 fp32 fp32 0.0123 8.5 -", cpu


def test_wide_adds_the_backend_and_when_each_profile_was_measured(server: StubServer) -> None:
    wide = run("cluster", "status", "-o", "wide")
    assert wide.exit_code == 0, wide.output
    header = next(line for line in wide.stdout.splitlines() if line.startswith("NODE TYPE"))
    assert "BACKEND" in header and "CREATED" in header
    assert "nccl" in wide.stdout and "2026-12-01T21:00:00" in wide.stdout and "…" not in wide.stdout


def test_json_is_the_apis_json_with_scheduler_and_profiles(server: StubServer) -> None:
    doc = json.loads(run("cluster", "status", "-o", "json").stdout)
    assert doc["scheduler"] == SCHEDULER and doc["profiles"] == PROFILES
    assert doc["nodes"] == CLUSTER["nodes"]


def test_no_leader_and_no_profile_say_so(server: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    view = copy.deepcopy(CLUSTER) | {"scheduler": {"leader": None, "since": None, "term": 0}, "profiles": []}
    monkeypatch.setattr("tests.cli.test_habits.CLUSTER", view)
    shown = run("cluster", "status")
    assert shown.exit_code == 0, shown.output
    assert "scheduler: no leader (none elected yet)" in shown.stdout
    assert "hardware profiles: none yet" in shown.stdout and "NODE TYPE" not in shown.stdout
    view["scheduler"]["term"] = 2  # the leader stopped and released its lease
    assert "scheduler: no leader (last term 2)" in run("cluster", "status").stdout
    monkeypatch.setattr("tests.cli.test_habits.CLUSTER", copy.deepcopy(CLUSTER))  # an older server
    assert "scheduler: not reported by this server" in run("cluster", "status").stdout


def test_status_shows_the_shared_cluster_when_it_is_up(server: StubServer, tmp_path: Path) -> None:
    me = (os.getpid(), process_start_time(os.getpid()) or 0)
    write_state(tmp_path, SharedClusterState("127.0.0.1:6380", "/tmp/x", [me], gpus=16, nodes=4))
    try:
        shown = run("cluster", "status")
        assert shown.exit_code == 0, shown.output
        first = shown.stdout.splitlines()[0]
        assert first == "embedded cluster: up at 127.0.0.1:6380, 16 virtual GPUs on 4 nodes"
        assert "scheduler: leader sched-host:4242" in shown.stdout
        assert json.loads(run("cluster", "status", "-o", "json").stdout)["scheduler"] == SCHEDULER
    finally:
        clear_state(tmp_path)


def test_status_without_a_server_still_says_where_the_shared_cluster_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))

    def unreachable(cls: Any, settings: Any, **kw: Any) -> Any:
        raise CliError("cannot reach the Lattice server at http://127.0.0.1:8000")

    monkeypatch.setattr(Client, "resolve", classmethod(unreachable))
    me = (os.getpid(), process_start_time(os.getpid()) or 0)
    write_state(tmp_path, SharedClusterState("127.0.0.1:6380", "/tmp/x", [me], gpus=16, nodes=4))
    try:
        shown = run("cluster", "status")
    finally:
        clear_state(tmp_path)
    assert shown.exit_code == 1
    assert shown.stdout.startswith("embedded cluster: up at 127.0.0.1:6380")
    assert "cannot reach the Lattice server" in shown.stderr


def test_a_measured_inter_node_link_gets_its_column(server: StubServer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    profiles = copy.deepcopy(PROFILES)
    profiles[-1]["inter_node_all_reduce"] = {"gbps": 1.63, "latency_us": 1125.0}
    view = copy.deepcopy(CLUSTER) | {"scheduler": SCHEDULER, "profiles": profiles}
    monkeypatch.setattr("tests.cli.test_habits.CLUSTER", view)
    lines = run("cluster", "status").stdout.splitlines()
    assert "cpu-virtual: all-reduce between nodes 1.63 GB/s + 1125 us" in lines
    assert all(len(line) <= 80 for line in lines)
    wide = run("cluster", "status", "-o", "wide").stdout
    header = next(line for line in wide.splitlines() if line.startswith("NODE TYPE"))
    assert "INTER-NODE" in header and "1.63 GB/s + 1125 us" in wide
