"""`lattice serve --role`: a scheduler process serves no API (only probes and metrics, when asked) and
leads while it holds the lease; the CLI refuses an unknown role."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from typer.testing import CliRunner

from service.cli import app as cli
from service.runtime import Runtime
from service.settings import Settings
from tests.control_plane.fakes import FakeWorkers


def test_a_scheduler_role_serves_probes_and_metrics_but_no_api(
    db_url: str, db_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeWorkers().install(monkeypatch)
    monkeypatch.setattr(Runtime, "_start_ray", lambda self: None)
    rt = Runtime(Settings(home=tmp_path / "s", database_url=db_url, scheduler_port=9999), role="scheduler")
    try:
        rt.start()
        assert rt.admin_token is None  # no API: no bootstrap token either
        assert rt.scheduler is not None and rt.scheduler.is_leader
        assert rt.app is not None
        with TestClient(rt.app) as c:
            assert c.get("/healthz").status_code == 200
            assert c.get("/v1/jobs").status_code == 404
            body = c.get("/metrics").text
        assert "lattice_scheduler_leader 1.0" in body
    finally:
        rt.stop()
    assert rt.scheduler is None
    plain = Runtime(Settings(home=tmp_path / "p", database_url=db_url), role="scheduler")
    try:
        plain.start()
        assert plain.app is None and plain.scheduler is not None
    finally:
        plain.stop()


def test_serve_refuses_an_unknown_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LATTICE_HOME", str(tmp_path))
    result = CliRunner().invoke(cli, ["serve", "--role", "everything"])
    assert result.exit_code != 0
    assert "--role must be one of all, api, scheduler" in result.output
