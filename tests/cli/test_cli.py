"""The `lattice` CLI against a live `lattice serve` (a real uvicorn process on a free port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import Result
from sqlalchemy import select
from typer.testing import CliRunner

from service import store
from service.cli import app
from service.store.db import make_engine, make_session_factory
from service.store.models import Job, JobState
from training.parallel.dist import free_port

ROOT = Path(__file__).resolve().parents[2]
SPEC = {
    "name": "cli-job",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "num_microbatches": 2},
}


class Server:
    def __init__(self, home: Path, url: str, stdout: str) -> None:
        self.home, self.url, self.stdout = home, url, stdout

    @property
    def env(self) -> dict[str, str]:
        return {"LATTICE_HOME": str(self.home), "LATTICE_SERVER": "", "LATTICE_TOKEN": ""}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("cli") / "home"
    port = free_port()
    log = home.parent / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
    env |= {"LATTICE_HOME": str(home), "LATTICE_LOG_LEVEL": "warning"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(port), "--api-only"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"lattice serve did not come up:\n{log.read_text()}")
            time.sleep(0.2)
        yield Server(home, url, log.read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(args: list[str], env: dict[str, str]) -> Result:
    return CliRunner().invoke(app, args, env=env)


def assert_one_line_error(result: Result, *words: str) -> None:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and "Traceback" not in result.output + result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_serve_bootstraps_an_admin_token_for_the_cli(server: Server) -> None:
    token_file = server.home / "token"
    token = token_file.read_text().strip()
    # stdout is a log file here, not a terminal: it says where the token is, never the token.
    assert token.startswith("lat_") and token not in server.stdout
    assert f"saved to {token_file} (mode 0600); not printed" in server.stdout
    assert (server.home / "server").read_text().strip() == server.url
    assert httpx.get(f"{server.url}/readyz").json()["status"] == "ready"


def test_serve_keeps_its_state_private(server: Server) -> None:
    home = server.home
    modes = {p.name: p.stat().st_mode & 0o777 for p in (home, *home.iterdir()) if p.name != "ray"}
    assert modes["home"] == 0o700 and modes["checkpoints"] == 0o700 and modes["data"] == 0o700
    for name in ("lattice.db", "lattice.db-wal", "lattice.db-shm", "token", "server"):
        assert modes[name] == 0o600, (name, oct(modes[name]))
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes


def test_token_list_revoke_and_ttl(server: Server) -> None:
    made = run(["token", "create", "--tenant", "team-t", "--ttl", "30d", "--description", "ttl"], server.env)
    assert made.exit_code == 0, made.stderr
    assert "expires 20" in made.stderr
    user_token = made.stdout.strip()
    token_id = int(made.stderr.split()[2])
    assert run(["--token", user_token, "jobs"], server.env).exit_code == 0  # a use, recorded

    listed = run(["token", "list", "--json"], server.env)
    assert listed.exit_code == 0, listed.stderr
    rows = {t["id"]: t for t in json.loads(listed.stdout)}
    assert rows[token_id]["tenant"] == "team-t" and rows[token_id]["expires_at"] is not None
    assert rows[token_id]["last_used_at"] is not None and rows[token_id]["status"] == "active"
    assert user_token not in listed.stdout
    table = run(["token", "list", "--tenant", "team-t"], server.env)
    assert table.exit_code == 0 and "team-t" in table.stdout and "active" in table.stdout

    mine = run(["--token", user_token, "token", "list", "--json"], server.env)
    assert [t["id"] for t in json.loads(mine.stdout)] == [token_id]  # a user sees their tenant only
    admin_id = next(i for i, t in rows.items() if t["role"] == "admin")
    assert_one_line_error(run(["--token", user_token, "token", "revoke", str(admin_id)], server.env), "404")

    revoked = run(["token", "revoke", str(token_id)], server.env)
    assert revoked.exit_code == 0 and f"token {token_id} (team-t, user): revoked at" in revoked.stdout
    assert_one_line_error(run(["--token", user_token, "jobs"], server.env), "401", "revoked")
    assert_one_line_error(run(["token", "revoke", "999999"], server.env), "404", "token 999999 not found")
    for ttl, words in (("3 fortnights", "use a whole number"), ("5s", "1 minute to 10 years")):
        bad = run(["token", "create", "--tenant", "x", "--ttl", ttl], server.env)
        assert_one_line_error(bad, "--ttl", words)


def test_submit_list_status_events_cancel(server: Server, tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    submitted = run(["submit", str(spec_file)], server.env)
    assert submitted.exit_code == 0, submitted.output + submitted.stderr
    job_id = submitted.stdout.split()[2]
    assert "pending" in submitted.stdout

    listed = run(["jobs", "--state", "pending"], server.env)
    assert listed.exit_code == 0 and job_id in listed.stdout
    shown = run(["status", job_id], server.env)
    assert shown.exit_code == 0 and "cli-job" in shown.stdout and "tp=2" in shown.stdout
    wide = run(["status", job_id, "-o", "wide"], server.env)  # the period the spec left out, filled in
    assert wide.exit_code == 0 and "checkpoints" in wide.stdout and "Young" in wide.stdout, wide.stdout
    cancelled = run(["cancel", job_id], server.env)
    assert cancelled.exit_code == 0 and f"job {job_id}: cancelled" in cancelled.stdout
    log = run(["events", job_id], server.env)
    assert log.exit_code == 0 and "created" in log.stdout and "cancelled" in log.stdout
    again = run(["cancel", job_id], server.env)
    assert again.exit_code == 0


def test_bad_files_and_bad_specs_give_one_line(server: Server, tmp_path: Path) -> None:
    assert_one_line_error(
        run(["submit", str(tmp_path / "missing.yaml")], server.env), "cannot read", "missing.yaml"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    assert_one_line_error(run(["submit", str(broken)], server.env), "not valid YAML")
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    assert_one_line_error(run(["submit", str(listing)], server.env), "must contain a job spec mapping")
    invalid = tmp_path / "invalid.json"
    invalid.write_text('{"name": "x", "model": {"preset": "nope"}, "train": {"steps": 1, "global_batch": 1}}')
    assert_one_line_error(run(["submit", str(invalid)], server.env), "422", "model.preset")
    assert_one_line_error(run(["status", "01NOSUCHJOB"], server.env), "404", "not found")


def test_unreachable_server_and_bad_token(server: Server, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    assert_one_line_error(run(["--server", dead, "jobs"], server.env), "cannot reach", dead)
    assert_one_line_error(run(["jobs"], server.env | {"LATTICE_SERVER": dead}), "cannot reach")
    assert_one_line_error(run(["--token", "lat_wrong", "jobs"], server.env), "401")
    for token in ("lat_caf\u00e9", "lat_a\nb", "lat a"):  # not sendable in a header: said, not sent
        assert_one_line_error(run(["--token", token, "jobs"], server.env), "token", "printable ASCII")
    assert_one_line_error(run(["--server", "http://[::1", "jobs"], server.env), "not a valid URL")


def test_names_given_to_the_cli_are_one_path_segment(server: Server, tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC))
    job_id = run(["submit", str(spec_file)], server.env).stdout.split()[2]
    assert run(["status", job_id], server.env).exit_code == 0
    # Unescaped, `x/../ID` would be normalised to the job's own path and show (or cancel) it.
    for args in (["status", f"x/../{job_id}"], ["cancel", f"x/../{job_id}"], ["events", f"x/../{job_id}"]):
        assert_one_line_error(run(args, server.env), "404")
    assert_one_line_error(run(["cluster", "cordon", "x/../n1"], server.env), "404")
    shown = run(["status", job_id], server.env)
    assert shown.exit_code == 0 and "pending" in shown.stdout  # the cancel above touched nothing


def test_token_create_makes_a_tenant_user(server: Server, tmp_path: Path) -> None:
    spec_file = tmp_path / "job.json"
    spec_file.write_text(json.dumps(SPEC))
    job_id = run(["submit", str(spec_file)], server.env).stdout.split()[2]

    made = run(["token", "create", "--tenant", "team-z"], server.env)
    assert made.exit_code == 0, made.stderr
    user_token = made.stdout.strip()
    assert user_token.startswith("lat_")
    as_user = run(["--token", user_token, "status", job_id], server.env)
    assert_one_line_error(as_user, "404")  # the admin's (default tenant's) job is invisible to team-z
    assert_one_line_error(run(["token", "create", "--tenant", "bad tenant!"], server.env), "--tenant")


def _drive(db_url: str, name: str, final: JobState, stop: threading.Event) -> None:
    """Play the scheduler's part: move the job through its states and report progress."""
    factory = make_session_factory(make_engine(db_url))
    job_id = None
    while job_id is None and not stop.is_set():
        with factory() as s:
            job_id = s.scalar(select(Job.id).where(Job.name == name))
        time.sleep(0.05)
    if job_id is None:
        return
    with store.session_scope(factory) as s:
        for state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING):
            store.transition(s, job_id, state)
    for step in range(1, 11):
        with store.session_scope(factory) as s:
            store.update_progress(s, job_id, step=step, loss=5.0 / step, tokens_per_s=1000.0)
        time.sleep(0.02)
    with store.session_scope(factory) as s:
        if final == JobState.SUCCEEDED:
            store.transition(s, job_id, final, set_fields={"result": {"model_digest": "abc123"}})
        else:
            store.transition(s, job_id, final, reason="rank 1 died 4 times")


@pytest.mark.parametrize(
    ("final", "code", "words"),
    [
        (JobState.SUCCEEDED, 0, "succeeded (model digest abc123)"),
        (JobState.FAILED, 1, "failed: rank 1 died 4 times"),
    ],
)
def test_watch_follows_progress_to_the_end(
    server: Server, tmp_path: Path, final: JobState, code: int, words: str
) -> None:
    name = f"watch-{final.value}"
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump(SPEC | {"name": name}))
    stop = threading.Event()
    driver = threading.Thread(
        target=_drive, args=(f"sqlite:///{server.home / 'lattice.db'}", name, final, stop)
    )
    driver.start()
    try:
        result = run(["submit", str(spec_file), "--watch", "--interval", "0.05"], server.env)
    finally:
        stop.set()
        driver.join(timeout=60)
    assert result.exit_code == code, result.output + result.stderr
    assert words in result.stdout + result.stderr
    assert "10/10" in result.stdout


def test_serve_help_lists_every_setting() -> None:
    from service.settings import Settings

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for name in Settings.model_fields:
        assert f"LATTICE_{name.upper()}" in result.stdout
