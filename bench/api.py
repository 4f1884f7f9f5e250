"""API throughput and latency: `lattice serve` on SQLite and on PostgreSQL at fixed request rates.

Starts a real `lattice serve` per backend (fresh SQLite file; fresh PostgreSQL schema), then
drives an open-loop schedule (request i is sent at t0 + i / rate, whether or not earlier ones
have answered) alternating job submits and job reads, and prints per backend, rate and operation:
accepted requests, refusals (429 / 503, each with Retry-After), other errors and timeouts, accepted
throughput, p50 and p99 latency of accepted requests and p99 of refusals.

With several `--rates` it also prints the knee (the offered rate with the most accepted throughput)
and, for each higher rate, accepted throughput as a fraction of the knee's: graceful overload keeps it
near 1.0 while the excess is refused fast. The per-token rate limit is off for the run (one token
drives the whole load); `LATTICE_MAX_INFLIGHT_REQUESTS` bounds what the API holds.

    python bench/api.py                                  # 200 req/s for 20 s on both backends
    python bench/api.py --rates 25,50,100,200,400 --duration 10 --backends sqlite
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.parallel.dist import free_port  # noqa: E402

DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SPEC = {
    "name": "bench",
    "model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 32},
    "train": {"steps": 10, "global_batch": 4},
    "parallelism": {"tp": 2, "dp": 2, "num_microbatches": 2},
}


@dataclass
class OpStats:
    latencies: list[float] = field(default_factory=list)  # accepted (2xx) requests
    refused: list[float] = field(default_factory=list)  # 429 / 503 with Retry-After
    errors: int = 0  # anything else: other statuses, a refusal without Retry-After, transport errors
    timeouts: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Service:
    """A `lattice serve` subprocess on a free port with its own home (and PostgreSQL schema)."""

    def __init__(self, backend: str, postgres_url: str) -> None:
        self.backend = backend
        self.home = Path(tempfile.mkdtemp(prefix=f"lattice-bench-{backend}-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.schema = f"bench_{uuid.uuid4().hex[:12]}" if backend == "postgresql" else None
        self.postgres_url = postgres_url
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Service:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
        env |= {"LATTICE_HOME": str(self.home), "LATTICE_LOG_LEVEL": "warning"}
        env["LATTICE_RATE_LIMIT_PER_S"] = "0"  # one token drives the whole load
        if self.schema:
            engine = create_engine(self.postgres_url)
            with engine.connect() as conn:
                conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
                conn.commit()
            engine.dispose()
            env["LATTICE_DATABASE_URL"] = f"{self.postgres_url}?options=-csearch_path%3D{self.schema}"
        log = open(self.home / "serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lattice serve did not start:\n{(self.home / 'serve.log').read_text()}")
            time.sleep(0.2)
        self.token = (self.home / "token").read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        if self.schema:
            engine = create_engine(self.postgres_url)
            with engine.connect() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
                conn.commit()
            engine.dispose()


async def drive(url: str, token: str, rate: float, duration: float, seed: int) -> dict[str, OpStats]:
    stats = {"submit": OpStats(), "get": OpStats()}
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=10) as client:
        first = await client.post("/v1/jobs", json=SPEC)
        first.raise_for_status()
        job_ids = [first.json()["id"]]

        async def one(op: str) -> None:
            start = time.perf_counter()
            try:
                if op == "submit":
                    r = await client.post("/v1/jobs", json=SPEC | {"priority": rng.randint(0, 9)})
                else:
                    r = await client.get(f"/v1/jobs/{rng.choice(job_ids)}")
            except httpx.TimeoutException:
                stats[op].timeouts += 1
                return
            except httpx.HTTPError:
                stats[op].errors += 1
                return
            elapsed = time.perf_counter() - start
            if r.status_code in (200, 201):
                stats[op].latencies.append(elapsed)
                if op == "submit":
                    job_ids.append(r.json()["id"])
            elif r.status_code in (429, 503) and "retry-after" in r.headers:
                stats[op].refused.append(elapsed)
            else:
                stats[op].errors += 1

        total = int(rate * duration)
        t0 = time.perf_counter()
        tasks = []
        for i in range(total):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one("submit" if i % 2 == 0 else "get")))
        await asyncio.gather(*tasks)
        stats["_wall"] = OpStats(latencies=[time.perf_counter() - t0])
    return stats


def report(backend: str, rate: float, stats: dict[str, OpStats]) -> float:
    """Print one line per operation; return the accepted throughput of both together."""
    wall = stats.pop("_wall").latencies[0]
    accepted = 0
    for op, s in stats.items():
        n = len(s.latencies)
        accepted += n
        refused = f"refused {len(s.refused):5d} (p99 {percentile(s.refused, 0.99) * 1e3:6.1f} ms)"
        failed = f"errors {s.errors:4d}  timeouts {s.timeouts:4d}"
        p50, p99 = percentile(s.latencies, 0.5) * 1e3, percentile(s.latencies, 0.99) * 1e3
        print(
            f"{backend:<10} {op:<6} offered {rate / 2:6.0f}/s  ok {n:6d}  {refused}  {failed}  "
            f"throughput {n / wall:7.1f}/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"
            if n
            else f"{backend:<10} {op:<6} no accepted requests ({refused}, {failed})"
        )
    return accepted / wall


def report_knee(backend: str, throughput: dict[float, float]) -> None:
    knee = max(throughput, key=lambda rate: throughput[rate])
    print(f"{backend:<10} knee: offered {knee:.0f} req/s, accepted {throughput[knee]:.1f} req/s")
    for rate in sorted(r for r in throughput if r > knee):
        print(f"{backend:<10}   at {rate / knee:.1f}x the knee ({rate:.0f} req/s): accepted "
              f"{throughput[rate]:.1f} req/s = {throughput[rate] / throughput[knee]:.2f} of the knee's")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", default="200", help="Comma-separated offered rates, requests per second (half submits)."
    )
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds of load per backend.")
    parser.add_argument(
        "--backends", default="sqlite,postgresql", help="Comma-separated: sqlite, postgresql."
    )
    parser.add_argument(
        "--postgres-url", default=DEFAULT_POSTGRES, help="PostgreSQL server (a schema is created)."
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print(
        f"lattice API bench: {args.rates} req/s for {args.duration:.0f} s each per backend, "
        f"open loop, submits and gets alternating; {os.cpu_count()} CPUs"
    )
    for backend in args.backends.split(","):
        throughput = {}
        for rate in rates:
            with Service(backend, args.postgres_url) as service:
                stats = asyncio.run(drive(service.url, service.token, rate, args.duration, args.seed))
            throughput[rate] = report(backend, rate, stats)
        if len(rates) > 1:
            report_knee(backend, throughput)


if __name__ == "__main__":
    main()
