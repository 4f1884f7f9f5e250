"""`lattice tenant set|list` send what the options say to /v1/tenants and show the answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from service.cli import app
from service.cli.client import Client

TENANT = {"name": "team-a", "max_priority": None, "default_max_priority": 100, "gpu_quota": 8,
          "weight": 2.0, "borrowing": True}


class Stub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def request(self, method: str, path: str, json: Any = None, **_: Any) -> Any:
        self.calls.append((method, path, json))
        if method == "GET":
            return {"items": [TENANT, TENANT | {"name": "team-b", "gpu_quota": None, "weight": 1.0,
                                                "borrowing": False, "max_priority": 300}]}
        return TENANT | dict(json)


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> Stub:
    server = Stub()
    monkeypatch.setattr(Client, "resolve", classmethod(lambda cls, settings, **kw: server))
    return server


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})


def test_tenant_set_sends_only_the_options_given(stub: Stub) -> None:
    r = run("tenant", "set", "team-a", "--quota", "16", "--weight", "3", "--no-borrowing")
    assert r.exit_code == 0, r.output
    sent = {"gpu_quota": 16, "weight": 3.0, "borrowing": False}
    assert stub.calls[-1] == ("PUT", "/v1/tenants/team-a", sent)
    assert "tenant team-a: GPU quota 16, weight 3, borrowing off, max priority default (100)" in r.stdout
    assert run("tenant", "set", "team-a", "--no-quota").exit_code == 0
    assert stub.calls[-1][2] == {"gpu_quota": None}


def test_tenant_set_usage_errors(stub: Stub) -> None:
    assert run("tenant", "set", "team-a").exit_code == 2  # nothing to set
    assert run("tenant", "set", "team-a", "--quota", "8", "--no-quota").exit_code == 2
    assert run("tenant", "set", "team-a", "--quota", "-1").exit_code == 2
    assert stub.calls == []


def test_tenant_list_table_and_json(stub: Stub) -> None:
    table = run("tenant", "list")
    assert table.exit_code == 0, table.output
    lines = [line.split() for line in table.stdout.splitlines()]
    assert ["team-a", "8", "2", "yes", "100", "(default)"] in lines
    assert ["team-b", "none", "1", "no", "300"] in lines
    data = json.loads(run("tenant", "list", "-o", "json").stdout)
    assert [t["name"] for t in data] == ["team-a", "team-b"]
