"""What `lattice serve` runs, in order: settings -> database migrations (and the bootstrap admin
token) -> Ray (an embedded local cluster, or `connect(LATTICE_RAY_ADDRESS)`) -> the scheduler
thread (which reconciles first) -> the HTTP API under uvicorn. `stop()` undoes it in reverse.

The role picks the parts: `all` (the default) runs everything; `api` runs the HTTP API on the
store only (no Ray: cluster views come from the nodes table and the leader lease the scheduler
writes), in `api_workers` processes behind one port when that is more than one (this process
migrates, then supervises them: uvicorn's multi-process mode); `scheduler` runs Ray and the scheduler
without HTTP. Every scheduler (roles `all` and `scheduler`) is elected (service.scheduler.leader):
with several, one acts and the others wait hot.

Job controllers are detached Ray actors: stopping the service leaves the jobs of an external
cluster running, and the next service re-attaches to them. The embedded cluster belongs to the
service and stops with it; the next service recovers its jobs from their checkpoints.

    with Runtime(settings) as rt:          # or rt = Runtime(settings).start() ... rt.stop()
        url = rt.serve_in_thread()         # the demo and the tests; `lattice serve` calls serve_forever()
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from fastapi import FastAPI
from sqlalchemy import Engine

from service.settings import Settings

Role = Literal["all", "api", "scheduler"]
log = logging.getLogger(__name__)

# Ray puts unix sockets under its temp dir (session_<date>_<pid>/sockets/plasma_store, ~62 bytes);
# a socket path must stay under ~107 bytes, so a deep Lattice home gets a short temp dir instead.
_MAX_RAY_ROOT = 40
WORKER_HEALTHCHECK_S = 30  # seconds an API worker may take to answer its supervisor's ping


class ServiceStartError(RuntimeError):
    """The service could not start (database, Ray); the message says which part and why."""


def ray_temp_dir(home: Path) -> str:
    root = str((home / "ray").resolve())
    if len(root) <= _MAX_RAY_ROOT:
        return root
    short = tempfile.mkdtemp(prefix="lattice-ray-")
    log.info("Ray's files go under %s (%s is too long a path for Ray's sockets)", short, root)
    return short


class Runtime:
    def __init__(
        self,
        settings: Settings,
        *,
        with_scheduler: bool = True,
        role: Role | None = None,
        controller_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        # with_scheduler=False is role `api`: API and store only (no Ray; another process schedules).
        self.role: Role = role or (settings.role if with_scheduler else "api")
        self.with_scheduler = self.role != "api"
        self.with_http = self.role != "scheduler"
        self.workers = settings.api_processes
        if self.workers > 1 and self.role != "api":
            raise ValueError(f"api_workers={self.workers} needs role api (role {self.role} runs one process)")
        self.controller_defaults = dict(controller_defaults or {})
        self.engine: Engine | None = None
        self.cluster: Any = None  # workers.cluster.EmbeddedCluster when we started one
        self.scheduler: Any = None
        self.app: FastAPI | None = None
        self.admin_token: str | None = None  # set when this start created the bootstrap token
        self._server: Any = None
        self._http_thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- start ------------------------------------------------------------------------------------
    def start(self) -> Runtime:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import SQLAlchemyError

        from service.api.app import create_app, create_probe_app
        from service.api.data_root import DataRootError, check_data_root
        from service.scheduler.leader import LeaderElector
        from service.scheduler.loop import Scheduler
        from service.statefiles import secure_home
        from service.store.db import is_sqlite, make_session_factory
        from service.store.prepare import prepare_database

        s = self.settings
        try:
            secure_home(s)  # 0700 folders, 0600 files: the database and the token file are private
        except OSError as e:
            raise ServiceStartError(f"cannot prepare the Lattice home {s.home}: {e.strerror or e}") from e
        try:
            check_data_root(s)  # before Ray or the database: a data root that exposes our state is fatal
        except DataRootError as e:
            raise ServiceStartError(str(e)) from e
        try:
            self.engine, self.admin_token = prepare_database(s, bootstrap=self.with_http)
        except SQLAlchemyError as e:
            where = make_url(s.db_url).render_as_string(hide_password=True)
            first = str(e).splitlines()[0]
            raise ServiceStartError(f"cannot prepare the database {where}: {first}") from e
        try:
            if self.with_scheduler:
                self._start_ray()
                elector = LeaderElector(
                    self.engine, lease_s=s.leader_lease_s, renew_s=s.leader_renew_s,
                    reap_dead_local_holder=is_sqlite(s.db_url),  # SQLite: every holder is on this host
                )
                self.scheduler = Scheduler(
                    s, elector.session_factory(self.engine),
                    read_session_factory=make_session_factory(self.engine, read_only=True),
                    controller_defaults=self.controller_defaults, leader=elector,
                )
                elector.on_change = self.scheduler.wake
                self.scheduler.start()
            if self.with_http:
                if self.workers == 1:  # several workers each build their own (worker_app)
                    self.app = create_app(s, engine=self.engine, scheduler=self.scheduler)
            elif s.scheduler_port is not None:  # probes and metrics only
                self.app = create_probe_app(s, engine=self.engine)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_ray(self) -> None:
        from workers.cluster import ClusterError, connect, start_embedded_cluster
        from workers.shared_cluster import live_address

        s = self.settings
        address = s.ray_address or live_address(s.home)  # `lattice cluster up` shares its cluster
        try:
            if address:
                connect(address)
                log.info("connected to the Ray cluster at %s", address)
            else:
                self.cluster = start_embedded_cluster(
                    racks=s.embedded_racks, nodes_per_rack=s.embedded_nodes_per_rack,
                    gpus_per_node=s.embedded_gpus_per_node, temp_dir=ray_temp_dir(s.home),
                )
        except ClusterError as e:
            raise ServiceStartError(str(e)) from e

    # ---- HTTP -------------------------------------------------------------------------------------
    def _server_for(self, host: str, port: int) -> Any:
        import uvicorn

        from service.api.shed_protocol import ShedHttpProtocol

        assert self.app is not None, "start() first"
        level = self.settings.log_level.lower()
        config = uvicorn.Config(self.app, host=host, port=port, log_level=level, access_log=level == "debug",
                                http=ShedHttpProtocol)
        return uvicorn.Server(config)

    def client_url(self, port: int | None = None) -> str:
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{host}:{port or self.settings.port}"

    def serve_forever(self) -> None:
        """Serve in this (main) thread until SIGINT/SIGTERM; uvicorn handles the signals. Role
        `scheduler` has no HTTP: it waits for the signal while its threads schedule; role `api` with
        several workers supervises them until the signal (each worker settles its own heap)."""
        if self.with_http and self.workers > 1:
            self._serve_workers()
            return
        settle_heap()
        if self.app is None:  # role scheduler without a probe port: no HTTP at all
            import signal

            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: self._stopping.set())
            while not self._stopping.wait(1.0):  # a timed wait lets the signal handler run
                pass
            return
        port = self.settings.port if self.with_http else self.settings.scheduler_port
        self._server = self._server_for(self.settings.host, port or self.settings.port)
        self._server.run()

    def _serve_workers(self) -> None:
        """uvicorn's multi-process mode: this process binds the port and keeps `workers` spawned
        processes serving it (a dead one is replaced; SIGINT/SIGTERM stop them all). Counters and
        histograms go to prometheus_client's multiprocess files, so /metrics on any worker sums them."""
        import uvicorn
        from uvicorn.supervisors import Multiprocess

        from service.api.shed_protocol import ShedHttpProtocol

        s = self.settings
        # Fresh (no stale counters) and on local disk (a counter increment writes to a memory-mapped
        # file: not on the home, which may be a shared network volume).
        metrics_dir = tempfile.mkdtemp(prefix="lattice-prometheus-")
        # prometheus_client reads this at import, in each spawned worker (they inherit the environment).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        level = s.log_level.lower()
        config = uvicorn.Config(
            functools.partial(worker_app, s, metrics_dir), factory=True, host=s.host, port=s.port,
            workers=self.workers, log_level=level, access_log=level == "debug", http=ShedHttpProtocol,
            # A worker whose pong thread misses the supervisor's ping is killed with its requests in
            # flight; on a starved host that is overload, not a hang: give it longer than uvicorn's 5 s.
            timeout_worker_healthcheck=WORKER_HEALTHCHECK_S,
        )
        sock = listening_socket(s.host, s.port)
        if self.engine is not None:
            self.engine.dispose()  # the supervisor is done with the database: hold no connection
        try:
            Multiprocess(config, sockets=[sock]).run()
        finally:
            sock.close()
            shutil.rmtree(metrics_dir, ignore_errors=True)

    def serve_in_thread(self, port: int | None = None, timeout_s: float = 30.0) -> str:
        """Serve in a background thread (port 0 or None = settings.port); returns the base URL.
        One process only: several API workers need `serve_forever()`."""
        if self.workers > 1:
            raise ServiceStartError("several API workers run as processes: use serve_forever()")
        self._server = self._server_for(self.settings.host, self.settings.port if port is None else port)
        self._http_thread = threading.Thread(target=self._server.run, name="lattice-http", daemon=True)
        self._http_thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise ServiceStartError(f"the HTTP server did not start on {self.settings.host}:{port}")
            time.sleep(0.05)
        sockets = [sock for srv in self._server.servers for sock in srv.sockets]
        bound = sockets[0].getsockname()[1] if sockets else (port or self.settings.port)
        return self.client_url(bound)

    # ---- stop -------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.should_exit = True
        if self._http_thread is not None:
            self._http_thread.join(30)
            self._http_thread = None
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
        if self.cluster is not None:
            log.info("stopping the embedded Ray cluster")
            self.cluster.shutdown()
            self.cluster = None
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def listening_socket(host: str, port: int) -> socket.socket:
    """The port the API workers share. uvicorn's own (`Config.bind_socket`) is made without naming
    the protocol (proto 0), accepted sockets inherit that, and asyncio sets TCP_NODELAY only where
    proto is IPPROTO_TCP: every response then waited ~40 ms for the client's delayed ACK (Nagle)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServiceStartError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)  # the spawned workers serve it
    return sock


def worker_app(settings: Settings, metrics_dir: str | None = None) -> FastAPI:
    """The app of one API worker process (role api, `api_workers` > 1): its own engine, database pool,
    load-shedding slots and planning pool; the supervising process has already migrated the database.
    `metrics_dir` (prometheus_client's multiprocess directory) makes /metrics sum all workers."""
    from service.api.app import create_app

    configure_logging(settings)
    app = create_app(worker_share(settings))
    app.state.metrics_dir = metrics_dir
    settle_heap()
    return app


def worker_share(settings: Settings) -> Settings:
    """One worker's settings out of `api_workers`: a token's rate limit is the replica's, so each worker
    bucket holds its share of the rate and the burst (a client cannot multiply its limit by opening
    connections that land on other workers; one whose requests all reach one worker gets that share)."""
    workers = settings.api_processes
    if workers <= 1:
        return settings
    burst = max(1, math.ceil(settings.rate_limit_burst / workers))
    return settings.model_copy(update={"rate_limit_per_s": settings.rate_limit_per_s / workers,
                                       "rate_limit_burst": burst})


def settle_heap() -> None:
    """Put what start-up allocated out of the cyclic collector's reach (gc.freeze, as Instagram's
    servers do): the imports, the app and its caches are ~125k objects, and a full collection over
    them held the GIL, and with it the event loop that sheds load, for 50-60 ms (measured on this
    2-core host); after the freeze it scans only what requests allocated since. Garbage made before
    is collected first."""
    gc.collect()
    gc.freeze()


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
