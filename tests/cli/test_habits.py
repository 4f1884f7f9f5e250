"""The CLI's habits (issue 15): tables that fit 80 columns without cutting a cell, `-o json` on
every read command, `--version`, exit codes (0 ok, 1 failed request or job, 2 usage), `events
--follow` and `status --watch` until the job ends, `lattice cluster`. The server is a stub client."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from click.testing import Result
from rich.console import Console
from typer.testing import CliRunner

from service.cli import app
from service.cli.client import Client, CliError
from service.cli.job_views import jobs_table, status_table

PROGRESS = {"step": 1000, "total_steps": 1000, "loss": 2.3456, "tokens_per_s": 12345.0, "step_time_s": 0.5,
            "mfu": 0.41, "eta_s": None, "goodput": {"useful_s": 500.0, "startup_s": 12.0}}
JOB: dict[str, Any] = {
    "id": "01JABCDEFGHJKMNPQRSTVWXYZ0", "name": "llama-pretrain-with-a-rather-long-name",
    "tenant": "research",
    "state": "succeeded", "reason": "succeeded after 1000 steps", "priority": 10, "attempt": 2,
    "progress": PROGRESS, "plan": {"layout": {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "zero_stage": 1}},
    "error": None, "result": {"model_digest": "abc123"}, "created_at": "2026-11-30T09:15:42.123456Z",
    "updated_at": "2026-11-30T10:15:42Z", "started_at": "2026-11-30T09:16:00Z", "finished_at": None,
}
JOBS = [
    JOB,
    JOB | {"id": "01JABCDEFGHJKMNPQRSTVWXYZ1", "name": "tiny", "state": "recovering",
           "reason": "recovering: rank 3 died on r1-n2", "progress": PROGRESS | {"step": 12, "loss": None}},
    JOB | {"id": "01JABCDEFGHJKMNPQRSTVWXYZ2", "name": "q", "state": "cancelled"},
]

JOBS_AT_80 = """\
ID                          NAME      STATE       STEP       LOSS    CREATED
01JABCDEFGHJKMNPQRSTVWXYZ0  llama-pr  succeeded   1000/1000  2.3456  11-30 09:15
                            etrain-w
                            ith-a-ra
                            ther-lon
                            g-name
01JABCDEFGHJKMNPQRSTVWXYZ1  tiny      recovering  12/1000    -       11-30 09:15
01JABCDEFGHJKMNPQRSTVWXYZ2  q         cancelled   1000/1000  2.3456  11-30 09:15
"""
STATUS_AT_80 = """\
id         01JABCDEFGHJKMNPQRSTVWXYZ0
name       llama-pretrain-with-a-rather-long-name
tenant     research
state      succeeded
reason     succeeded after 1000 steps
priority   10
attempt    2
progress   1000/1000
loss       2.3456
tokens/s   12345
step time  0.5s
mfu        41.00%
eta        -
time       useful 8m20s, startup 12.0s
layout     tp=2 pp=2 dp=2 cp=1 zero_stage=1
created    2026-11-30T09:15:42.123456Z
"""


def _at_80(table: Any) -> str:
    console = Console(width=80, record=True, highlight=False, file=open("/dev/null", "w"))
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def test_jobs_and_status_tables_at_80_columns_are_golden() -> None:
    assert _at_80(jobs_table(JOBS, wide=False)) == JOBS_AT_80
    assert _at_80(status_table(JOB, wide=False)) == STATUS_AT_80


def test_a_long_error_folds_instead_of_being_cut() -> None:
    error = "rank 3 raised RuntimeError: " + "x" * 150 + " END"
    text = _at_80(status_table(JOB | {"state": "failed", "error": error}, wide=False))
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    first = next(i for i, line in enumerate(lines) if line.startswith("error"))
    folded = "".join(line[11:].strip() for line in lines[first:])
    assert folded.replace(" ", "") == error.replace(" ", "")  # every character, in order (wrapped at spaces)
    assert "…" not in text


class StubServer:
    """The API as the CLI sees it: canned answers, a job that moves through `states` (one per GET)."""

    def __init__(self, states: list[str] | None = None, events: int = 250) -> None:
        self.states = states or ["succeeded"]
        self.events = [{"seq": i, "time": f"2026-11-30T09:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
                        "type": "progress", "payload": {"step": i, "note": "y" * 120}}
                       for i in range(1, events + 1)]
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def request(self, method: str, path: str, params: dict[str, Any] | None = None, **_: Any) -> Any:
        params = params or {}
        self.calls.append((method, path, params))
        parts = path.strip("/").split("/")
        if path == "/v1/jobs":
            return {"items": copy.deepcopy(JOBS), "next_cursor": None}
        if path == "/v1/tokens":
            return {"items": [{"id": 1, "tenant": "research", "role": "admin", "status": "active",
                               "description": None, "created_at": "2026-11-30T09:00:00Z",
                               "expires_at": None, "last_used_at": None}]}
        if path == "/v1/cluster":
            return CLUSTER
        if parts[:3] == ["v1", "cluster", "nodes"]:
            node = next(n for n in CLUSTER["nodes"] if n["id"] == parts[3])
            return node | {"cordoned": parts[4] in ("cordon", "drain")}
        if parts[2] != JOB["id"]:
            raise CliError(f"404 Not Found: job {parts[2]!r} not found")
        if path.endswith("/logs/index"):
            return {"job_id": JOB["id"], "state": "succeeded", "attempts": [
                {"attempt": 1, "ranks": [{"rank": 0, "bytes": 10}, {"rank": 1, "bytes": 5}]}]}
        if path.endswith("/events"):
            after, limit = params.get("after", 0), params.get("limit", 100)
            assert 1 <= limit <= 1000  # the API's bounds
            page = [e for e in self.events if e["seq"] > after][: limit + 1]
            next_after = page[limit - 1]["seq"] if len(page) > limit else None
            return {"items": page[:limit], "next_after": next_after}
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return copy.deepcopy(JOB) | {"state": state}


CLUSTER = {
    "source": "live", "gpu_type": "H100-80GB", "gpus_total": 16, "gpus_free": 4, "gpus_schedulable": 4,
    "links": None, "racks": [{"name": "r1", "nodes": ["r1-n1", "r1-n2"], "gpus_total": 16, "gpus_free": 4}],
    "nodes": [{"id": f"r1-n{i}", "ray_node_id": f"ray{i}", "rack": "r1", "hostname": f"host{i}",
               "gpus_total": 8, "gpus_free": 4 * (i - 1), "alive": True, "health": "ready",
               "cordoned": False, "schedulable": True, "fault_count": 0, "last_fault": None}
              for i in (1, 2)],
}


@pytest.fixture
def stub(monkeypatch: pytest.MonkeyPatch) -> StubServer:
    server = StubServer()
    monkeypatch.setattr(Client, "resolve", classmethod(lambda cls, settings, **kw: server))
    return server


def run(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})


READS = [("jobs",), ("status", JOB["id"]), ("events", JOB["id"]), ("token", "list"), ("cluster", "status"),
         ("logs", JOB["id"], "--list")]


@pytest.mark.parametrize("read", READS, ids=lambda r: " ".join(r[:2]))
def test_every_read_command_prints_parseable_json_and_a_wide_table(stub: StubServer, read: tuple) -> None:
    result = run(*read, "-o", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data
    wide = run(*read, "-o", "wide")
    assert wide.exit_code == 0, wide.output
    assert "…" not in wide.stdout
    assert run(*read, "-o", "yaml").exit_code == 2  # usage


def test_json_is_the_apis_json(stub: StubServer) -> None:
    assert json.loads(run("status", JOB["id"], "-o", "json").stdout) == JOB
    assert json.loads(run("jobs", "--json").stdout) == JOBS
    assert json.loads(run("cluster", "status", "-o", "json").stdout) == CLUSTER


def test_events_reads_every_page_and_never_cuts_the_payload(stub: StubServer) -> None:
    events = json.loads(run("events", JOB["id"], "-o", "json").stdout)
    assert [e["seq"] for e in events] == list(range(1, 251))
    table = run("events", JOB["id"])
    assert table.exit_code == 0 and "…" not in table.stdout
    assert "250" in table.stdout and table.stdout.count("y") >= 250 * 120
    assert [e["seq"] for e in json.loads(run("events", JOB["id"], "--limit", "7", "--json").stdout)] == [
        *range(1, 8)]


def test_events_follow_stops_when_the_job_is_terminal(stub: StubServer) -> None:
    stub.states = ["running", "running", "failed"]
    stub.events = stub.events[:3]
    result = run("events", JOB["id"], "--follow", "--interval", "0.01", "-o", "json")
    assert result.exit_code == 1  # the job failed
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["seq"] for e in lines] == [1, 2, 3]  # each once
    assert sum(1 for m, p, _ in stub.calls if p == f"/v1/jobs/{JOB['id']}") == 3
    stub.states, stub.calls = ["succeeded"], []
    assert run("events", JOB["id"], "-f", "--interval", "0.01").exit_code == 0


def test_status_watch_refreshes_until_terminal(stub: StubServer) -> None:
    stub.states = ["queued", "running", "succeeded"]
    result = run("status", JOB["id"], "--watch", "--interval", "0.01")
    assert result.exit_code == 0, result.output
    assert "succeeded" in result.stdout and not stub.states[1:]


def test_exit_codes(stub: StubServer) -> None:
    assert run("status", JOB["id"]).exit_code == 0
    stub.states = ["failed"]
    assert run("status", JOB["id"]).exit_code == 1  # a failed job
    stub.states = ["cancelled"]
    assert run("status", JOB["id"]).exit_code == 0
    missing = run("status", "01NOSUCHJOB")
    assert missing.exit_code == 1 and missing.stderr.startswith("error: 404")  # a failed request
    assert run("jobs", "--no-such-flag").exit_code == 2  # usage
    assert run("jobs", "--limit", "0").exit_code == 2
    assert run("status").exit_code == 2
    assert "Exit codes: 0 ok" in run("--help").stdout


def test_version_and_completion() -> None:
    from importlib.metadata import version

    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"lattice {version('lattice')}"
    assert "--install-completion" in run("--help").stdout
    shown = CliRunner().invoke(app, ["--show-completion", "bash"], env={"SHELL": "/bin/bash"})
    assert shown.exit_code == 0 and "complete" in shown.stdout


def test_cluster_status_cordon_uncordon(stub: StubServer) -> None:
    shown = run("cluster", "status")
    assert shown.exit_code == 0 and "r1-n2" in shown.stdout and "4/8" in shown.stdout
    assert "live view, H100-80GB: 4/16 GPUs free on 2 nodes" in shown.stdout
    cordoned = run("cluster", "cordon", "r1-n2")
    assert cordoned.exit_code == 0 and "node r1-n2: cordoned" in cordoned.stdout
    assert ("POST", "/v1/cluster/nodes/r1-n2/cordon", {}) in stub.calls
    assert "not cordoned" in run("cluster", "uncordon", "r1-n2").stdout
    drained = run("cluster", "drain", "r1-n2")
    assert drained.exit_code == 0 and "node r1-n2: cordoned" in drained.stdout
    assert ("POST", "/v1/cluster/nodes/r1-n2/drain", {}) in stub.calls
