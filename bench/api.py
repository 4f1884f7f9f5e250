"""API throughput and latency: `lattice serve` on SQLite and on PostgreSQL at fixed request rates.

Starts a real `lattice serve` per backend (fresh SQLite file; fresh PostgreSQL schema), then
drives an open-loop schedule (request i is sent at t0 + i / rate, whether or not earlier ones
have answered) alternating job submits and job reads, and prints per backend, rate and operation:
accepted requests, refusals (429 / 503, each with Retry-After), other errors and timeouts, accepted
throughput, p50 and p99 latency of accepted requests and p99 of refusals.

With several `--rates` it also prints the knee (the lowest offered rate within 5% of the best accepted
throughput; a sweep whose every rate was served in full has none, and says so) and, for each higher
rate, accepted throughput as a fraction of the knee's: graceful overload keeps it near 1.0 while the
excess is refused fast. The per-token rate limit is off for the run (one token
drives the whole load); `LATTICE_API_THREADS`, `LATTICE_MAX_QUEUE_WAIT_MS` and
`LATTICE_MAX_INFLIGHT_REQUESTS` shape what the API runs, queues and refuses (`--server-env` sets them).
The generator is a lean HTTP/1.1 client (httpx cost more CPU per request than the server); latency
counts from each request's scheduled send time; `/healthz` is probed every 100 ms throughout.

`--role api` starts `lattice serve --role api` (HTTP only, no Ray: what a production replica runs;
when `serve` has no `--role`, it says so and measures the full server). `--replicas 1,2` runs, at
each offered rate, one replica and then two against the same database (the load alternating between
them) and prints the two-replica / one-replica throughput ratio; `--workers 1,2` does the same for
worker processes of one `--role api` server (`lattice serve --workers N`, one port).

The generator runs each measurement with Python's cyclic garbage collector paused (`quiet_collector`):
a full collection of its own heap (httpx, SQLAlchemy and the bench imported, ~210,000 objects) took
96 ms on this VM, and every request scheduled meanwhile was charged the pause although the server sat
idle (its threads waiting for work, its CPU time flat): the "stalls" at 100 req/s of earlier runs.

Each run also prints where the CPU went: the generator's own CPU per request sent, the servers' CPU
(every worker process included, from /proc) per request and in cores, and the connections the
generator had to open (a server that closes keep-alive connections makes it reconnect).

    python bench/api.py                                  # 200 req/s for 20 s on both backends
    python bench/api.py --rates 25,50,100,200,400 --duration 10 --backends sqlite
    python bench/api.py --role api --replicas 1,2 --rates 100,400 --duration 10
    python -m bench.api --role api --workers 1,2 --rates 100,200,400,800 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


KEEPALIVE_REUSE_S = 4.0  # below uvicorn's timeout_keep_alive (5 s)


@dataclass
class OpStats:
    latencies: list[float] = field(default_factory=list)  # accepted (2xx) requests
    refused: list[float] = field(default_factory=list)  # 429 / 503 with Retry-After
    errors: int = 0  # anything else: other statuses, a refusal without Retry-After, transport errors
    error_kinds: Counter[str] = field(default_factory=Counter)
    timeouts: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def serve_has_role() -> bool:
    out = subprocess.run([sys.executable, "-m", "service", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, env=os.environ | {"COLUMNS": "200"})
    return "--role" in out.stdout


class Service:
    """`replicas` x `lattice serve` subprocesses, each on a free port, sharing one home and one
    database (a fresh SQLite file, or a fresh PostgreSQL schema)."""

    def __init__(self, backend: str, postgres_url: str, role: str | None = None, replicas: int = 1,
                 extra_env: dict[str, str] | None = None, workers: int | None = None) -> None:
        self.backend, self.workers = backend, workers
        self.extra_env = extra_env or {}
        self.home = Path(tempfile.mkdtemp(prefix=f"lattice-bench-{backend}-"))
        self.role, self.replicas = role, replicas
        self.urls: list[str] = []
        self.schema = f"bench_{uuid.uuid4().hex[:12]}" if backend == "postgresql" else None
        self.postgres_url = postgres_url
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return self.urls[0]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
        env |= {"LATTICE_HOME": str(self.home), "LATTICE_LOG_LEVEL": "warning"}
        env["LATTICE_RATE_LIMIT_PER_S"] = "0"  # one token drives the whole load
        if self.schema:
            env["LATTICE_DATABASE_URL"] = f"{self.postgres_url}?options=-csearch_path%3D{self.schema}"
        return env | self.extra_env

    def _start_one(self, env: dict[str, str], i: int) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
        if self.role is not None:
            command += ["--role", self.role]
        if self.workers is not None:  # None: the server's default (auto: one per usable CPU)
            command += ["--workers", str(self.workers)]
        log = open(self.home / f"serve-{i}.log", "w")
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log_text = (self.home / f"serve-{i}.log").read_text()
                raise RuntimeError(f"lattice serve did not start:\n{log_text}")
            time.sleep(0.2)
        if self.workers != 1:
            time.sleep(5)  # /readyz answered from one worker; the others are still importing
        self.urls.append(url)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the servers and their live descendants (the worker processes)."""
        pids = {proc.pid for proc in self.procs}
        stats = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields:  # after "(comm)": state, ppid, ..., utime (12th), stime (13th)
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        frontier = set(pids)
        while frontier:
            frontier = {pid for pid, (ppid, _) in stats.items() if ppid in frontier and pid not in pids}
            pids |= frontier
        return sum(stats[pid][1] for pid in pids if pid in stats) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Service:
        if self.schema:
            engine = create_engine(self.postgres_url)
            with engine.connect() as conn:
                conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
                conn.commit()
            engine.dispose()
        env = self._env()
        for i in range(self.replicas):  # one after the other: the first migrates and mints the token
            self._start_one(env, i)
        self.token = (self.home / "token").read_text().strip()
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)
        if self.schema:
            engine = create_engine(self.postgres_url)
            with engine.connect() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
                conn.commit()
            engine.dispose()


class Http1Client:
    """A lean HTTP/1.1 keep-alive client for the load generator: at most `max_connections` open, each
    carrying one request at a time. httpx's AsyncClient spent ~8 ms of CPU per request on this 2-core
    machine (more than the server's ~7 ms), so the generator, not the server, set the latency it saw."""

    def __init__(self, url: str, headers: dict[str, str], max_connections: int = 256) -> None:
        self.host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.port = int(port)
        fixed = [f"Host: {self.host}:{self.port}"] + [f"{k}: {v}" for k, v in headers.items()]
        self.fixed = "".join(line + "\r\n" for line in fixed)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []  # (..., idle since)
        self.slots = asyncio.Semaphore(max_connections)
        self.opened = 0  # connections this client had to open

    async def request(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-cased headers, body)."""
        async with self.slots:
            reader, writer = await self._connection()
            try:
                length = f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n" if body else ""
                writer.write(f"{method} {path} HTTP/1.1\r\n{self.fixed}{length}\r\n".encode() + (body or b""))
                await writer.drain()
                lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                fields = (line.partition(":") for line in lines[1:])
                headers = {k.strip().lower(): v.strip() for k, _, v in fields}
                if "chunked" in headers.get("transfer-encoding", ""):
                    raise ConnectionError("a chunked response (this client reads Content-Length bodies only)")
                data = await reader.readexactly(int(headers.get("content-length", "0")))
            except BaseException:
                writer.close()  # a timeout or a broken connection: never reuse it
                raise
            if headers.get("connection", "").lower() == "close":
                writer.close()
            else:
                self.idle.append((reader, writer, time.monotonic()))
            return int(lines[0].split()[1]), headers, data

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The most recently used idle connection that the server has not closed (uvicorn closes one
        idle for 5 s: reusing it would lose the request), else a new one."""
        while self.idle:
            reader, writer, since = self.idle.pop()
            if not reader.at_eof() and time.monotonic() - since < KEEPALIVE_REUSE_S:
                return reader, writer
            writer.close()
        self.opened += 1
        return await asyncio.open_connection(self.host, self.port)


async def probe_health(url: str, stop: asyncio.Event, out: list[float], period_s: float = 0.1) -> None:
    """GET /healthz every `period_s` on a connection of its own (never queued behind the load)."""
    client = Http1Client(url, {}, max_connections=1)
    while not stop.is_set():
        start = time.perf_counter()
        try:
            status, _, _ = await asyncio.wait_for(client.request("GET", "/healthz"), 10)
            out.append(time.perf_counter() - start if status == 200 else float("inf"))
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            out.append(float("inf"))
        await asyncio.sleep(period_s)
    client.close()


async def drive(urls: list[str], token: str, rate: float, duration: float, seed: int) -> dict[str, OpStats]:
    """The open-loop schedule; a request's latency runs from its scheduled send time (so a lagging
    generator shows, and coordinated omission does not hide the server's queue)."""
    stats = {"submit": OpStats(), "get": OpStats()}
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {token}"}
    clients = {url: Http1Client(url, headers) for url in urls}
    status, _, body = await clients[urls[0]].request("POST", "/v1/jobs", json.dumps(SPEC).encode())
    if status not in (200, 201):
        raise RuntimeError(f"the first submit failed: {status} {body[:200]!r}")
    job_ids = [json.loads(body)["id"]]
    health: list[float] = []
    stop = asyncio.Event()
    prober = asyncio.create_task(probe_health(urls[0], stop, health))

    async def one(op: str, url: str, scheduled: float) -> None:
        if op == "submit":
            call = clients[url].request("POST", "/v1/jobs",
                                        json.dumps(SPEC | {"priority": rng.randint(0, 9)}).encode())
        else:
            call = clients[url].request("GET", f"/v1/jobs/{rng.choice(job_ids)}")
        try:
            status, headers, body = await asyncio.wait_for(call, 10)
        except TimeoutError:
            stats[op].timeouts += 1
            return
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            stats[op].errors += 1
            stats[op].error_kinds[type(e).__name__] += 1
            return
        elapsed = time.perf_counter() - scheduled
        if status in (200, 201):
            stats[op].latencies.append(elapsed)
            if op == "submit":
                job_ids.append(json.loads(body)["id"])
        elif status in (429, 503) and "retry-after" in headers:
            stats[op].refused.append(elapsed)
        else:
            stats[op].errors += 1
            stats[op].error_kinds[f"HTTP {status}"] += 1

    total = int(rate * duration)
    t0 = time.perf_counter()
    tasks = []
    lag = 0.0
    for i in range(total):
        scheduled = t0 + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, -delay)
        url = urls[(i // 2) % len(urls)]  # each replica gets submits and gets alike
        tasks.append(asyncio.create_task(one("submit" if i % 2 == 0 else "get", url, scheduled)))
    await asyncio.gather(*tasks)
    opened = sum(c.opened for c in clients.values())
    stats["_wall"] = OpStats(latencies=[time.perf_counter() - t0, lag, opened])
    stop.set()
    await prober
    stats["_health"] = OpStats(latencies=health)
    for client in clients.values():
        client.close()
    return stats


def report(backend: str, rate: float, stats: dict[str, OpStats], cpu: tuple[float, float]) -> float:
    """Print one line per operation; return the accepted throughput of both together. `cpu`: CPU
    seconds of the generator and of the servers during the run."""
    wall, lag, opened = stats.pop("_wall").latencies
    health = stats.pop("_health").latencies
    accepted = 0
    for op, s in stats.items():
        n = len(s.latencies)
        accepted += n
        refused = f"refused {len(s.refused):5d} (p99 {percentile(s.refused, 0.99) * 1e3:6.1f} ms)"
        kinds = f" {dict(s.error_kinds)}" if s.error_kinds else ""
        failed = f"errors {s.errors:4d}{kinds}  timeouts {s.timeouts:4d}"
        p50, p99 = percentile(s.latencies, 0.5) * 1e3, percentile(s.latencies, 0.99) * 1e3
        print(
            f"{backend:<10} {op:<6} offered {rate / 2:6.0f}/s  ok {n:6d}  {refused}  {failed}  "
            f"throughput {n / wall:7.1f}/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms"
            if n
            else f"{backend:<10} {op:<6} no accepted requests ({refused}, {failed})"
        )
    print(f"{backend:<10} /healthz during the load: {len(health)} probes, p99 "
          f"{percentile(health, 0.99) * 1e3:.1f} ms, max {max(health, default=float('nan')) * 1e3:.1f} ms; "
          f"generator lag max {lag * 1e3:.0f} ms; load average {os.getloadavg()[0]:.1f}")
    sent = sum(len(s.latencies) + len(s.refused) + s.errors + s.timeouts for s in stats.values())
    gen, server = cpu
    print(f"{backend:<10} CPU: generator {gen / sent * 1e3:.2f} ms/request ({gen / wall:.2f} cores), "
          f"servers {server / sent * 1e3:.2f} ms/request ({server / wall:.2f} cores); "
          f"{opened:.0f} connections opened")
    return accepted / wall


PLATEAU = 0.95  # the knee: the lowest offered rate accepting this share of the best throughput measured


WARMUP_RATE = 50.0  # req/s: well under one server process's capacity


def knee_of(throughput: dict[float, float]) -> float:
    """Where the accepted-throughput curve flattens: the lowest offered rate whose throughput is within
    5% of the best. The best rate itself is a noisy pick along the plateau (last runs: 200 or 400 req/s
    for ~190 accepted), and 4x a late pick would measure the generator's CPU rather than the server."""
    best = max(throughput.values())
    return min(rate for rate in throughput if throughput[rate] >= PLATEAU * best)


def served_in_full(throughput: dict[float, float]) -> bool:
    """Every offered rate accepted (within 5%): the sweep never reached the server's capacity, so it
    has no knee (knee_of would pick its highest rate) and needs higher --rates to find one."""
    return all(accepted >= PLATEAU * rate for rate, accepted in throughput.items())


def paired_ratios(pairs: list[tuple[float, float]]) -> list[float]:
    """Accepted at 4x / accepted at the knee, for each (knee, 4x) pair measured back to back."""
    return [four / knee if knee > 0 else 0.0 for knee, four in pairs]


def report_knee(backend: str, throughput: dict[float, float]) -> None:
    knee = knee_of(throughput)
    best = max(throughput, key=lambda rate: throughput[rate])
    print(f"{backend:<10} knee: offered {knee:.0f} req/s, accepted {throughput[knee]:.1f} req/s (the best: "
          f"{throughput[best]:.1f} req/s at {best:.0f} offered)")
    for rate in sorted(r for r in throughput if r > knee):
        print(f"{backend:<10}   at {rate / knee:.1f}x the knee ({rate:.0f} req/s): accepted "
              f"{throughput[rate]:.1f} req/s = {throughput[rate] / throughput[knee]:.2f} of the knee's")


@contextlib.contextmanager
def quiet_collector() -> Any:
    """No cyclic garbage collection in the generator while it measures: what lives now is frozen out of
    the collector's view and automatic collections stop until the run ends (refcounting still frees
    almost everything the requests allocate); the cycles left over are collected afterwards, and the
    collector is left as it was found (enabled or not; a freeze from before stays)."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if frozen == 0:  # what this froze goes back; an earlier freeze cannot be told apart, so it stays
            gc.unfreeze()
        if enabled:
            gc.enable()
        gc.collect()


def measure(label: str, rate: float, args: argparse.Namespace, server: tuple[Any, ...]) -> float:
    """One rate against a fresh service: accepted requests per second (report's table rows printed).
    The service first serves `args.warmup` seconds at a rate under its capacity, not counted: its
    database connections open, statements compile and threads start, as in a service that has run."""
    backend, role, replicas, extra_env, workers = server
    with Service(backend, args.postgres_url, role, replicas, extra_env, workers) as service:
        if args.warmup > 0:
            warm = min(rate, WARMUP_RATE)
            asyncio.run(drive(service.urls, service.token, warm, args.warmup, args.seed + 1))
        stats, cpu = timed_drive(service, rate, args.duration, args.seed)
    return report(label, rate, stats, cpu)


def timed_drive(service: Service, rate: float, seconds: float, seed: int) -> tuple[dict[str, OpStats],
                                                                                  tuple[float, float]]:
    """One measured run with the generator's collector paused: its stats, and the CPU seconds of the
    generator and of the servers during it."""
    with quiet_collector():
        gen0, server0 = time.process_time(), service.cpu_s()
        stats = asyncio.run(drive(service.urls, service.token, rate, seconds, seed))
        return stats, (time.process_time() - gen0, service.cpu_s() - server0)


def merge(chunks: list[dict[str, OpStats]]) -> dict[str, OpStats]:
    """Several `drive` results as one run: the operations' samples concatenated, the walls and the
    connections opened added, the generator's lag the largest."""
    walls = [stats["_wall"].latencies for stats in chunks]  # (wall, lag, connections opened) each
    merged = {"_wall": OpStats(latencies=[sum(w[0] for w in walls), max(w[1] for w in walls),
                                          sum(w[2] for w in walls)])}
    for stats in chunks:
        for op, s in stats.items():
            if op == "_wall":
                continue
            into = merged.setdefault(op, OpStats())
            into.latencies += s.latencies
            into.refused += s.refused
            into.errors += s.errors
            into.error_kinds += s.error_kinds
            into.timeouts += s.timeouts
    return merged


def interleaved(label: str, rates: tuple[float, float], args: argparse.Namespace,
                server: tuple[Any, ...]) -> tuple[float, float]:
    """Accepted throughput at two offered rates on one service, in `args.chunks` alternating chunks of
    `args.duration / args.chunks` seconds each (a, b, a, b, ...): this host's speed moves by 2x over
    seconds to minutes (docs/benchmarks.md, "Planner accuracy", session 35), so runs of 20 s one after
    the other compare two stretches of the host as much as two loads; alternating chunks put both
    rates in the same stretches. Each chunk drains before the next starts."""
    backend, role, replicas, extra_env, workers = server
    runs: dict[float, list[dict[str, OpStats]]] = {rate: [] for rate in rates}
    cpu = {rate: [0.0, 0.0] for rate in rates}
    seconds = args.duration / args.chunks
    with Service(backend, args.postgres_url, role, replicas, extra_env, workers) as service:
        if args.warmup > 0:
            asyncio.run(drive(service.urls, service.token, min(rates[0], WARMUP_RATE), args.warmup,
                              args.seed + 1))
        for chunk in range(args.chunks):
            for rate in rates:
                stats, (gen, served) = timed_drive(service, rate, seconds, args.seed + 2 + chunk)
                runs[rate].append(stats)
                cpu[rate][0] += gen
                cpu[rate][1] += served
    a, b = (report(label, rate, merge(runs[rate]), (cpu[rate][0], cpu[rate][1])) for rate in rates)
    return a, b


def sweep(
    label: str, rates: list[float], args: argparse.Namespace, server: tuple[Any, ...]
) -> dict[float, float]:
    """Accepted throughput per offered rate (the median of `args.repeat` runs, in rounds across the rates:
    a slow minute of the host hits them all), 4x the knee added; the knee printed."""
    runs: dict[float, list[float]] = {rate: [] for rate in rates}
    for _ in range(args.repeat):
        for rate in rates:
            runs[rate].append(measure(label, rate, args, server))
    throughput = {rate: statistics.median(values) for rate, values in runs.items()}
    unsaturated = served_in_full(throughput)
    if len(rates) > 1:
        if args.four_x and (four := 4 * (knee := knee_of(throughput))) not in throughput:
            # 4x and the knee measured side by side, pair by pair: a slow minute of the host hits both
            # runs of a pair, not only the 4x runs that would otherwise all come after the sweep
            if args.chunks > 1:
                pairs = [interleaved(label, (knee, four), args, server) for _ in range(args.repeat)]
            else:
                pairs = [(measure(label, knee, args, server), measure(label, four, args, server))
                         for _ in range(args.repeat)]
            runs[knee] += [k for k, _ in pairs]
            runs[four] = [f for _, f in pairs]
            throughput[knee], throughput[four] = statistics.median(runs[knee]), statistics.median(runs[four])
            ratios = paired_ratios(pairs)
            how = f"in {args.chunks} alternating chunks on one service" if args.chunks > 1 else "back to back"
            print(f"{label:<10} 4x / the knee, measured {how}: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f})")
        if args.repeat > 1:
            for rate, values in sorted(runs.items()):
                each = ", ".join(f"{v:.1f}" for v in values)
                print(f"{label:<10} {rate:.0f} req/s offered: accepted {each} "
                      f"(median {throughput[rate]:.1f})")
        if unsaturated:  # the "4x" pair is then 4x the highest rate, itself under the knee
            print(f"{label:<10} no knee within the sweep: every rate up to {max(rates):.0f} req/s was served "
                  f"in full (the pairs above used it); add higher --rates to find the knee")
        report_knee(label, throughput)
    return throughput


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
    parser.add_argument("--repeat", type=int, default=1,
                        help="Runs of every rate (in rounds across the rates); medians are used.")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help=f"Seconds at min(rate, {WARMUP_RATE:.0f}) req/s before each measurement, "
                        "not counted.")
    parser.add_argument("--role", choices=["all", "api"], default=None,
                        help="`lattice serve --role` of the server (default: serve's default, all).")
    parser.add_argument("--server-env", action="append", default=[], metavar="LATTICE_X=V",
                        help="A setting for the servers (repeatable), e.g. LATTICE_API_THREADS=40.")
    parser.add_argument("--replicas", default="1",
                        help="Comma-separated replica counts, e.g. 1,2: each at every rate, with the ratio.")
    parser.add_argument("--workers", default="auto", help="Comma-separated `lattice serve --workers` counts "
                        "(role api), e.g. 1,2: each at every rate, with the ratio (auto: the server's "
                        "default, one per usable CPU).")
    parser.add_argument("--four-x", action=argparse.BooleanOptionalAction, default=True,
                        help="With several rates: also measure 4x the knee when the rates lack it.")
    parser.add_argument("--chunks", type=int, default=5,
                        help="The (knee, 4x) pairs: measured on one service in this many alternating "
                        "chunks of --duration / chunks seconds each (1: two fresh services, one "
                        "--duration run each, back to back).")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    configs = [(int(r), None if w == "auto" else int(w))
               for r in args.replicas.split(",") for w in args.workers.split(",")]
    role = args.role
    extra_env = dict(item.split("=", 1) for item in args.server_env)
    if role is not None and not serve_has_role():
        print(f"note: this `lattice serve` has no --role; measuring the full server instead of --role {role}")
        role = None
    print(
        f"lattice API bench: {args.rates} req/s for {args.duration:.0f} s each per backend, "
        f"open loop, submits and gets alternating; role {role or 'all (default)'}, replicas "
        f"{args.replicas}, workers {args.workers}; {os.cpu_count()} CPUs; "
        f"server settings {extra_env or 'default'}"
    )
    throughput: dict[tuple[str, int, int], dict[float, float]] = {}
    for backend in args.backends.split(","):
        for replicas, workers in configs:
            key = (backend, replicas, workers)
            label = backend + (f"x{replicas}" if replicas > 1 else "")
            label += f"w{workers}" if workers is not None and workers > 1 else ""
            server = (backend, role, replicas, extra_env, workers)
            throughput[key] = sweep(label, rates, args, server)
        base_r, base_w = configs[0]
        base = throughput[(backend, base_r, base_w)]
        for replicas, workers in configs[1:]:
            for rate in rates:
                other = throughput[(backend, replicas, workers)][rate]
                ratio = other / base[rate] if base[rate] else float("nan")
                shown, base_shown = workers or "auto", base_w or "auto"  # None: the server's default
                print(f"{backend:<10} {replicas} replicas x {shown} workers / {base_r} x {base_shown} at "
                      f"{rate:.0f} req/s offered: throughput ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
