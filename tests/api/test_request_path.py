"""The request path's transactions (issue 14 item 5): a read never takes SQLite's write lock (no
`BEGIN IMMEDIATE`) and a GET never commits (on PostgreSQL a commit is a round trip and a WAL
flush); a submit takes the write lock once, for its write, not for its idempotency lookup, its
policy check or while it plans."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event

from tests.api.conftest import bearer

SPEC = {
    "name": "path",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "num_microbatches": 2},
}


@contextmanager
def statements(engine: Engine) -> Iterator[Counter[str]]:
    seen: Counter[str] = Counter()

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        words = statement.split()
        seen[" ".join(words[:2]).upper() if words[:1] == ["BEGIN"] else words[0].upper()] += 1

    def on_commit(conn: Any) -> None:
        seen["COMMIT"] += 1

    def on_begin(conn: Any) -> None:  # on either backend (PostgreSQL's BEGIN is not a statement)
        seen["transactions"] += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(engine, "commit", on_commit)
    event.listen(engine, "begin", on_begin)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
        event.remove(engine, "commit", on_commit)
        event.remove(engine, "begin", on_begin)


def test_a_get_reads_without_the_write_lock_and_never_commits(client: TestClient, db_engine: Engine,
                                                               tokens: dict[str, str]) -> None:
    auth = bearer(tokens["a"])
    job = client.post("/v1/jobs", json=SPEC, headers=auth).json()
    client.get(f"/v1/jobs/{job['id']}", headers=auth)  # the token's use is recorded (a write) at most once
    with statements(db_engine) as seen:
        for _ in range(3):
            r = client.get(f"/v1/jobs/{job['id']}", headers=auth)
            assert r.status_code == 200 and r.json()["id"] == job["id"]
        listed = client.get("/v1/jobs", headers=auth)
        assert listed.status_code == 200 and [j["id"] for j in listed.json()["items"]] == [job["id"]]
    assert seen["SELECT"] >= 4
    assert seen["BEGIN IMMEDIATE"] == 0, seen
    assert seen["COMMIT"] == 0, seen
    assert seen["INSERT"] == seen["UPDATE"] == 0, seen


def test_a_read_looks_up_its_token_in_its_own_read_transaction(
    client: TestClient, db_engine: Engine, tokens: dict[str, str]
) -> None:
    """The token lookup and the route's read share the request's read session (service.api.deps
    .get_reader): one transaction per GET, not one for the token and another for the job."""
    auth = bearer(tokens["a"])
    job = client.post("/v1/jobs", json=SPEC, headers=auth).json()
    client.get(f"/v1/jobs/{job['id']}", headers=auth)  # the token's use is recorded (a write) at most once
    for path in (f"/v1/jobs/{job['id']}", "/v1/jobs", f"/v1/jobs/{job['id']}/events"):
        with statements(db_engine) as seen:
            assert client.get(path, headers=auth).status_code == 200
        assert seen["transactions"] == 1, (path, seen)
        assert seen["SELECT"] >= 2, (path, seen)  # the token, then the route's read
    with statements(db_engine) as seen:  # a refused token ends the read before the 401
        assert client.get(f"/v1/jobs/{job['id']}", headers=bearer("lat_nope")).status_code == 401
    assert seen["transactions"] == 1 and seen["COMMIT"] == 0, seen
    revoked = client.delete(f"/v1/tokens/{_token_id(client, tokens)}", headers=bearer(tokens["admin"]))
    assert revoked.status_code == 200, revoked.text
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).status_code == 401  # revocation is immediate


def _token_id(client: TestClient, tokens: dict[str, str]) -> int:
    listed = client.get("/v1/tokens", params={"tenant": "team-a"}, headers=bearer(tokens["admin"])).json()
    (row,) = listed["items"]
    return int(row["id"])


def test_a_submit_serialises_its_job_once_and_answers_with_the_stored_job(
    client: TestClient, tokens: dict[str, str], monkeypatch: Any
) -> None:
    """The JSON that proves a new job can be served (before its commit) is the response's body."""
    from service.schemas import JobPublic

    auth = bearer(tokens["a"])
    client.get("/v1/jobs", headers=auth)
    from_row = JobPublic.from_row
    rows: list[str] = []

    def counting(job: Any) -> JobPublic:
        rows.append(job.id)
        return from_row(job)

    monkeypatch.setattr(JobPublic, "from_row", counting)
    r = client.post("/v1/jobs", json=SPEC, headers=auth | {"Idempotency-Key": "once"})
    assert r.status_code == 201 and r.headers["Location"] == f"/v1/jobs/{r.json()['id']}"
    assert rows == [r.json()["id"]]
    assert r.headers["content-type"] == "application/json"
    stored = client.get(f"/v1/jobs/{r.json()['id']}", headers=auth).json()
    assert _timeless(r.json()) == _timeless(stored)
    assert 0 <= r.json()["progress"]["goodput"]["queued_s"] <= stored["progress"]["goodput"]["queued_s"]
    replay = client.post("/v1/jobs", json=SPEC, headers=auth | {"Idempotency-Key": "once"})
    assert replay.status_code == 200 and replay.headers["Idempotent-Replayed"] == "true"
    assert _timeless(replay.json()) == _timeless(r.json())


def _timeless(job: dict[str, Any]) -> dict[str, Any]:
    """A job without its goodput, the split of the wall time up to when it was serialised."""
    return {**job, "progress": {k: v for k, v in job["progress"].items() if k != "goodput"}}


def test_a_submit_takes_the_write_lock_once(client: TestClient, db_engine: Engine,
                                            tokens: dict[str, str]) -> None:
    auth = bearer(tokens["a"])
    client.get("/v1/jobs", headers=auth)  # record the token's use first (a write of its own)
    with statements(db_engine) as seen:
        r = client.post("/v1/jobs", json=SPEC, headers=auth | {"Idempotency-Key": "k-1"})
        assert r.status_code == 201, r.text
    # Two transactions on either backend: one read (the token, the key, the tenant's priority cap and
    # the hardware profile; each had its own once, then the token had its own) and one write.
    assert seen["transactions"] == 2, seen
    if db_engine.dialect.name == "sqlite":
        assert seen["BEGIN IMMEDIATE"] == 1, seen  # the job, its event and the key, in one transaction
        assert seen["BEGIN"] == 1, seen  # the read: deferred, no write lock for the lookups
    assert seen["INSERT"] >= 2  # the job and its first event at least
    with statements(db_engine) as seen:
        again = client.post("/v1/jobs", json=SPEC, headers=auth | {"Idempotency-Key": "k-1"})
    assert again.status_code == 200 and again.json()["id"] == r.json()["id"]  # the replay
    assert seen["BEGIN IMMEDIATE"] == 0 and seen["INSERT"] == 0, seen  # a replay only reads


def test_a_request_waits_for_a_worker_thread_only_where_it_does_blocking_io(
    client: TestClient, tokens: dict[str, str], monkeypatch: Any
) -> None:
    """Dependencies without I/O (settings, scheduler, admin check, making a session) run on the event
    loop: a submit or a get hops to a thread for the token lookup and the route (each hop waits for a
    thread when busy). Their results are serialised, and a get's read transaction ended, on the
    route's thread (service.api.responses): FastAPI's validation and the session's close took a hop
    each."""
    import anyio.to_thread

    hops: list[str] = []
    run_sync = anyio.to_thread.run_sync

    async def counting(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(func, "__qualname__", repr(func)))
        return await run_sync(func, *args, **kwargs)

    auth = bearer(tokens["a"])
    job = client.post("/v1/jobs", json=SPEC, headers=auth).json()
    client.get(f"/v1/jobs/{job['id']}", headers=auth)  # warm: the token's use is recorded once a minute
    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    assert client.post("/v1/jobs", json=SPEC, headers=auth).status_code == 201
    submit_hops, hops[:] = list(hops), []
    assert client.get(f"/v1/jobs/{job['id']}", headers=auth).status_code == 200
    assert 1 <= len(submit_hops) <= 2, submit_hops  # at least the route itself: the count is live
    assert 1 <= len(hops) <= 2, hops
    assert not any("serialize" in h or "validate" in h for h in submit_hops + hops), (submit_hops, hops)


def test_a_submit_writes_three_rows_and_updates_none(client: TestClient, db_engine: Engine,
                                                     tokens: dict[str, str]) -> None:
    """A new job's write is the job, its `created` event (seq 1, allocated with the row: nobody else
    sees the job before the commit) and the idempotency key: no UPDATE to allocate the event's seq,
    and no tenant upsert for a token's tenant (a token's tenant exists: foreign key)."""
    auth = bearer(tokens["a"])
    client.get("/v1/jobs", headers=auth)  # record the token's use first (a write of its own)
    with statements(db_engine) as seen:
        r = client.post("/v1/jobs", json=SPEC, headers=auth | {"Idempotency-Key": "k-rows"})
        assert r.status_code == 201, r.text
    assert seen["INSERT"] == 3 and seen["UPDATE"] == 0, seen
    job_id = r.json()["id"]
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)  # the next event takes seq 2
    assert cancelled.status_code == 200, cancelled.text
    events = client.get(f"/v1/jobs/{job_id}/events", headers=auth).json()["items"]
    assert [(e["seq"], e["type"]) for e in events][:2] == [(1, "created"), (2, events[1]["type"])]
    assert events[0]["payload"] == {"state": "pending", "name": "path", "tenant": "team-a"}
