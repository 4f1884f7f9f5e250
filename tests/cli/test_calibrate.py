"""`lattice calibrate`: measures this machine on a reduced grid and stores a versioned profile."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.store.db import make_engine, make_session_factory
from service.store.profiles import newest_profile


def _env(tmp_path: Path) -> dict[str, str]:
    return {"LATTICE_HOME": str(tmp_path / "home"), "LATTICE_DATABASE_URL": f"sqlite:///{tmp_path / 'l.db'}",
            "COLUMNS": "200"}  # fmt: skip


def test_calibrate_measures_and_stores_a_profile(tmp_path: Path) -> None:
    r = CliRunner().invoke(
        app, ["calibrate", "--quick", "--node-type", "cpu", "-o", "json"], env=_env(tmp_path)
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["node_type"], doc["version"], doc["compute_dtype"], doc["backend"]) == (
        "cpu-virtual",
        1,
        "fp32",
        "gloo",
    )
    assert len(doc["matmul"]["fp32"]) >= 3 and all(p[3] > 0 for p in doc["matmul"]["fp32"])
    assert set(doc["collectives"]) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "send_recv",
        "all_to_all",
    }
    assert all(t > 0 for pts in doc["collectives"].values() for _, t in pts)
    # Up to a message whose time is bandwidth, not latency (the fit's bandwidth needs one), each size
    # timed on both ranks the same number of times (else the two ranks' loops would hang each other).
    assert all(max(b for b, _ in pts) >= 1 << 20 and len(pts) == 3 for pts in doc["collectives"].values())
    assert doc["memory_bw"] > 0 and doc["attention"]
    # The op overhead: the mean of windows taken before and after each compute phase.
    windows = doc["meta"]["op_overhead_windows_us"]
    assert len(windows) == 5 and min(windows) - 0.01 <= doc["op_overhead_s"] * 1e6 <= max(windows) + 0.01
    # More processes than cores (training/calibration/oversubscription.py): each workload at 2 and 4 a core.
    cores = os.cpu_count() or 1
    levels = [min(32, level * cores) / cores for level in (2, 4)]
    assert {k: [a for a, _ in pts] for k, pts in doc["oversubscription"].items()} == {
        "ops": levels, "matmul": levels}
    assert doc["meta"]["phases"]["oversubscription"] > 0
    # The engine's own costs on the 2 gloo ranks (training/calibration/engine.py), one size each.
    assert doc["concurrency"] >= 1.0
    assert len(doc["tp_linear"]) == len(doc["fsdp_unit"]) == len(doc["ddp_step"]) == 1
    assert all(b > 0 and t >= 0 for b, t in doc["tp_linear"] + doc["fsdp_unit"] + doc["ddp_step"])
    # DTensor dispatch costs an AdamW step something per tensor over plain shards (~0.4 ms here).
    assert doc["fsdp_optimizer_tensor_s"] > 0
    engine = make_engine(f"sqlite:///{tmp_path / 'l.db'}")
    with make_session_factory(engine)() as s:
        stored = newest_profile(s, "cpu-virtual")
    engine.dispose()
    assert stored is not None and stored.to_dict() == doc


def test_calibrate_refuses_an_unknown_node_type(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["calibrate", "--node-type", "tpu-v9", "--no-save"], env=_env(tmp_path))
    assert r.exit_code == 1
    assert "--node-type" in r.output and "cpu-virtual" in r.output


def test_cluster_status_prints_the_newest_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli.client import Client
    from tests.cli import test_habits

    summary = {"node_type": "H100-80GB", "version": 3, "created_at": None, "compute_dtype": "bf16",
               "matmul_tflops": {"fp32": 48.0, "bf16": 690.0}, "memory_gbps": 3900.0, "backend": "nccl",
               "all_reduce": {"gbps": 350.0, "latency_us": 12.0}}  # fmt: skip
    monkeypatch.setitem(test_habits.CLUSTER, "profiles", [summary])
    server = test_habits.StubServer()
    monkeypatch.setattr(Client, "resolve", classmethod(lambda cls, settings, **kw: server))
    shown = test_habits.run("cluster", "status")
    assert shown.exit_code == 0, shown.output
    row = next(" ".join(line.split()) for line in shown.stdout.splitlines() if line.startswith("H100-80GB"))
    assert row.startswith("H100-80GB v3 bf16 fp32 48, bf16 690 3900 350 GB/s + 12 us")
