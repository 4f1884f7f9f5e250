"""Where one submit and one get spend their time: cProfile over the real app in-process (httpx's
ASGI transport on this thread's event loop; the sync routes run inline instead of on a worker
thread, so that the profile sees the whole request) against SQLite and PostgreSQL, after a warm-up.
Prints, per backend and operation, the mean wall time per request, the SQL statements each request
sends (by kind: BEGIN, SELECT, INSERT, UPDATE, COMMIT) and its hops to a worker thread (every
sync dependency and the sync route itself; each waits for a thread when the API is busy), the own
time by layer (SQLAlchemy, pydantic, JSON, starlette, Lattice's own, ...) and the functions with
the most cumulative time.

    python bench/profile_api.py                        # both backends, 200 of each
    python bench/profile_api.py --backends sqlite --n 100 --top 25
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, create_engine, event, text  # noqa: E402

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SPEC = {
    "name": "bench",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "num_microbatches": 2},
}
LAYERS = [("sqlalchemy", "sqlalchemy"), ("psycopg", "psycopg"), ("sqlite3", "sqlite3"),
          ("pydantic", "pydantic"), ("json", "json"), ("starlette", "starlette"), ("anyio", "anyio"),
          ("fastapi", "fastapi"),
          ("planner", "service/planner"), ("lattice", "service/"), ("httpx", "httpx")]


class StatementCounter:
    def __init__(self, engine: Engine) -> None:
        self.counts: Counter[str] = Counter()
        event.listen(engine, "before_cursor_execute", self._on_execute)
        event.listen(engine, "commit", lambda conn: self.counts.update(["COMMIT"]))
        event.listen(engine, "rollback", lambda conn: self.counts.update(["ROLLBACK"]))

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.counts[statement.split(None, 1)[0].upper()] += 1


def _layer(filename: str) -> str:
    for name, marker in LAYERS:
        if marker in filename:
            return name
    return "other"


def profile(
    label: str, fn: Callable[[int], Awaitable[Any]], n: int, counter: StatementCounter, top: int,
    sort: str = "cumulative",
) -> None:
    async def many(start: int, count: int) -> None:
        for i in range(start, start + count):
            await fn(i)

    loop = asyncio.new_event_loop()
    loop.run_until_complete(many(0, 10))  # warm-up: imports, caches, the connection pool
    counter.counts.clear()
    cpu0, own0 = time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    loop.run_until_complete(many(10, n))  # once without the profiler: what a request really costs
    bare, cpu = (time.perf_counter() - t0) / n, (time.process_time() - cpu0) / n
    own = (time.thread_time() - own0) / n  # this thread's: the request itself, not the app's other threads
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    loop.run_until_complete(many(10 + n, n))
    prof.disable()
    loop.close()
    wall = (time.perf_counter() - t0) / n
    stats = pstats.Stats(prof)
    per_layer: Counter[str] = Counter()
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        per_layer[_layer(filename)] += tottime / n
    statements = ", ".join(f"{k} {v / n / 2:.1f}" for k, v in sorted(counter.counts.items()))
    print(f"\n== {label}: {bare * 1e3:.2f} ms/request wall, {cpu * 1e3:.2f} ms CPU without the profiler "
          f"({own * 1e3:.2f} ms on the requests' thread); "
          f"{wall * 1e3:.2f} ms/request wall under it; "
          f"statements and thread hops per request: {statements}")
    print("   own time per request by layer: " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in per_layer.most_common()))
    stats.sort_stats(sort).print_stats(top)


def run_backend(backend: str, url: str, n: int, top: int, sort: str = "cumulative") -> None:
    import anyio.to_thread
    import httpx

    from service.api.app import create_app
    from service.auth import create_token
    from service.settings import Settings
    from service.store.db import make_engine, make_session_factory
    from service.store.prepare import prepare_database

    home = Path(tempfile.mkdtemp(prefix="lattice-profile-"))
    settings = Settings(home=home, database_url=url, rate_limit_per_s=0, max_inflight_requests=0)
    engine, _ = prepare_database(settings, bootstrap=False)
    engine.dispose()
    engine = make_engine(settings.db_url)
    with make_session_factory(engine)() as s:
        token = create_token(s, tenant="bench", admin=False)
        s.commit()
    counter = StatementCounter(engine)
    headers = {"Authorization": f"Bearer {token}"}
    ids: list[str] = []

    async def inline(func: Callable[..., Any], *args: Any, **_: Any) -> Any:
        counter.counts["thread hop"] += 1  # each is a wait for a worker thread when the API is busy
        return func(*args)

    anyio.to_thread.run_sync = inline  # type: ignore[assignment]  # the whole request on this thread
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, engine=engine)),
                               base_url="http://bench")

    async def submit(i: int) -> None:
        r = await client.post("/v1/jobs", json=SPEC, headers=headers | {"Idempotency-Key": uuid.uuid4().hex})
        assert r.status_code in (200, 201), r.text
        ids.append(r.json()["id"])

    async def get(i: int) -> None:
        r = await client.get(f"/v1/jobs/{ids[i % len(ids)]}", headers=headers)
        assert r.status_code == 200, r.text

    profile(f"{backend} submit (with an Idempotency-Key)", submit, n, counter, top, sort)
    profile(f"{backend} get", get, n, counter, top, sort)
    engine.dispose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--sort", default="cumulative", help="pstats order of the top functions, e.g. tottime.")
    p.add_argument("--postgres-url", default=os.environ.get("LATTICE_TEST_POSTGRES_URL", DEFAULT_POSTGRES))
    args = p.parse_args()
    for backend in args.backends.split(","):
        if backend == "sqlite":
            url = f"sqlite:///{tempfile.mkdtemp(prefix='lattice-profile-db-')}/lattice.db"
            run_backend(backend, url, args.n, args.top, args.sort)
        else:
            schema = f"profile_{uuid.uuid4().hex[:8]}"
            admin = create_engine(args.postgres_url)
            with admin.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            sep = "&" if "?" in args.postgres_url else "?"
            url = f"{args.postgres_url}{sep}options=-csearch_path%3D{schema}"
            try:
                run_backend(backend, url, args.n, args.top, args.sort)
            finally:
                with admin.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
                admin.dispose()


if __name__ == "__main__":
    main()
