"""GET /v1/jobs/{id}/logs and /logs/index over files as the ranks write them (workers.logs)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.settings import Settings
from service.store.models import JobState
from tests.api.conftest import bearer
from tests.api.specs import tiny
from workers.logs import RotatingWriter, job_logs_dir, new_attempt, rank_log_path


def _logs_dir(settings: Settings, job_id: str) -> Path:
    assert settings.checkpoint_root is not None
    return job_logs_dir(settings.checkpoint_root / job_id)


def _write(settings: Settings, job_id: str, attempt: int, rank: int, text: str) -> Path:
    path = rank_log_path(_logs_dir(settings, job_id), attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)
    return path


def _wait_opened(path: Path, timeout_s: float = 60.0) -> None:
    """Until a read-only file handle of this process is open on `path` (the route following it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != str(path):
                    continue
                flags = next(ln for ln in open(f"/proc/self/fdinfo/{fd}") if ln.startswith("flags:"))
            except (OSError, StopIteration):
                continue
            if int(flags.split()[1], 8) & os.O_ACCMODE == os.O_RDONLY:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing opened {path}")


def _submit(client: TestClient, token: str) -> str:
    r = client.post("/v1/jobs", json=tiny(), headers=bearer(token))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _move(sf: sessionmaker[Session], job_id: str, *states: JobState) -> None:
    with store.session_scope(sf) as s:
        for state in states:
            store.transition(s, job_id, state)


def test_logs_default_to_rank_0_of_the_latest_attempt_and_select_tail_and_index(
    client: TestClient, tokens: dict[str, str], settings: Settings
) -> None:
    h = bearer(tokens["a"])
    job_id = _submit(client, tokens["a"])
    r = client.get(f"/v1/jobs/{job_id}/logs", headers=h)
    assert r.status_code == 404 and "no logs yet" in r.json()["detail"]
    for attempt in (1, 2):
        for rank in (0, 1):
            text = "".join(f"a{attempt} r{rank} line {i}\n" for i in range(5))
            _write(settings, job_id, attempt, rank, text)
    r = client.get(f"/v1/jobs/{job_id}/logs", headers=h)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.text == "".join(f"a2 r0 line {i}\n" for i in range(5))
    assert (r.headers["x-lattice-log-rank"], r.headers["x-lattice-log-attempt"]) == ("0", "2")
    r = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1, "attempt": 1, "tail": 2}, headers=h)
    assert r.text == "a1 r1 line 3\na1 r1 line 4\n"

    index = client.get(f"/v1/jobs/{job_id}/logs/index", headers=h).json()
    assert index["latest"] == 2 and index["state"] == "pending"
    found = [(a["attempt"], [x["rank"] for x in a["ranks"]]) for a in index["attempts"]]
    assert found == [(1, [0, 1]), (2, [0, 1])]
    assert index["attempts"][0]["ranks"][0]["bytes"] == len("".join(f"a1 r0 line {i}\n" for i in range(5)))

    r = client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 7}, headers=h)
    assert r.status_code == 404 and "attempts with logs: 1-2" in r.json()["detail"]
    r = client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 5}, headers=h)
    assert r.status_code == 404 and "ranks with logs: 0-1" in r.json()["detail"]


def test_another_tenant_gets_404_and_bad_parameters_are_422(
    client: TestClient, tokens: dict[str, str], settings: Settings
) -> None:
    job_id = _submit(client, tokens["a"])
    _write(settings, job_id, new_attempt(_logs_dir(settings, job_id)), 0, "secret of team-a\n")
    for path in (f"/v1/jobs/{job_id}/logs", f"/v1/jobs/{job_id}/logs/index"):
        theirs = client.get(path, headers=bearer(tokens["b"]))
        assert theirs.status_code == 404 and "secret" not in theirs.text
        job_404 = client.get(f"/v1/jobs/{job_id}", headers=bearer(tokens["b"]))
        assert theirs.json()["detail"] == job_404.json()["detail"]
        assert client.get(path, headers=bearer(tokens["admin"])).status_code == 200
    assert client.get(f"/v1/jobs/{job_id}/logs").status_code == 401
    for params, field in (({"rank": -1}, "rank"), ({"tail": 0}, "tail"), ({"attempt": "../x"}, "attempt"),
                          ({"attempt": 0}, "attempt")):
        r = client.get(f"/v1/jobs/{job_id}/logs", params=params, headers=bearer(tokens["a"]))
        assert r.status_code == 422, (params, r.text)
        assert [e["field"] for e in r.json()["errors"]] == [field]
    assert client.get("/v1/jobs/..%2F..%2Fetc/logs", headers=bearer(tokens["a"])).status_code in (404, 422)


def test_follow_streams_until_the_job_is_terminal_and_moves_to_a_new_attempt(
    client: TestClient, tokens: dict[str, str], settings: Settings, db_session_factory: sessionmaker[Session]
) -> None:
    h = bearer(tokens["a"])
    job_id = _submit(client, tokens["a"])
    _move(db_session_factory, job_id, JobState.QUEUED, JobState.STARTING, JobState.RUNNING)
    logs = _logs_dir(settings, job_id)
    first_path = rank_log_path(logs, new_attempt(logs), 0)
    first = RotatingWriter(first_path, max_bytes=128, backups=1)
    first.write("before follow\n")

    def the_job() -> None:  # writes while the request follows, restarts once, then fails
        _wait_opened(first_path.resolve())
        for i in range(6):
            first.write(f"attempt 1 line {i} 0123456789\n")  # rotates once (128 bytes): nothing is lost
        first.close()
        second_path = rank_log_path(logs, new_attempt(logs), 0)
        second = RotatingWriter(second_path)
        second.write("attempt 2 says hello\n")
        _wait_opened(second_path.resolve())
        second.write("attempt 2 last words\n")
        second.close()
        _move(db_session_factory, job_id, JobState.FAILED)

    writer = threading.Thread(target=the_job)
    writer.start()
    try:
        r = client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true", "tail": 1}, headers=h)
    finally:
        writer.join()
    assert r.status_code == 200
    expected = ("before follow\n" + "".join(f"attempt 1 line {i} 0123456789\n" for i in range(6))
                + "\n==> attempt 2 <==\nattempt 2 says hello\nattempt 2 last words\n")
    assert r.text == expected
    # The job is terminal now: follow returns the whole log at once.
    again = client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true", "attempt": 2}, headers=h)
    assert again.text == "attempt 2 says hello\nattempt 2 last words\n"
