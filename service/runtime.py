"""What `lattice serve` runs, in order: settings -> database migrations (and the bootstrap admin
token) -> Ray (an embedded local cluster, or `connect(LATTICE_RAY_ADDRESS)`) -> the scheduler
thread (which reconciles first) -> the HTTP API under uvicorn. `stop()` undoes it in reverse.

Job controllers are detached Ray actors: stopping the service leaves the jobs of an external
cluster running, and the next service re-attaches to them. The embedded cluster belongs to the
service and stops with it; the next service recovers its jobs from their checkpoints.

    with Runtime(settings) as rt:          # or rt = Runtime(settings).start() ... rt.stop()
        url = rt.serve_in_thread()         # the demo and the tests; `lattice serve` calls serve_forever()
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from fastapi import FastAPI
from sqlalchemy import Engine

from service.settings import Settings

log = logging.getLogger(__name__)

# Ray puts unix sockets under its temp dir (session_<date>_<pid>/sockets/plasma_store, ~62 bytes);
# a socket path must stay under ~107 bytes, so a deep Lattice home gets a short temp dir instead.
_MAX_RAY_ROOT = 40


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
        controller_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.with_scheduler = with_scheduler  # False: API and store only (no Ray, jobs stay pending)
        self.controller_defaults = dict(controller_defaults or {})
        self.engine: Engine | None = None
        self.cluster: Any = None  # workers.cluster.EmbeddedCluster when we started one
        self.scheduler: Any = None
        self.app: FastAPI | None = None
        self.admin_token: str | None = None  # set when this start created the bootstrap token
        self._server: Any = None
        self._http_thread: threading.Thread | None = None

    # ---- start ------------------------------------------------------------------------------------
    def start(self) -> Runtime:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import SQLAlchemyError

        from service.api.app import create_app
        from service.api.data_root import DataRootError, check_data_root
        from service.scheduler.loop import Scheduler
        from service.statefiles import secure_home
        from service.store.db import make_session_factory
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
            self.engine, self.admin_token = prepare_database(s, bootstrap=True)
        except SQLAlchemyError as e:
            where = make_url(s.db_url).render_as_string(hide_password=True)
            first = str(e).splitlines()[0]
            raise ServiceStartError(f"cannot prepare the database {where}: {first}") from e
        try:
            if self.with_scheduler:
                self._start_ray()
                self.scheduler = Scheduler(
                    s, make_session_factory(self.engine),
                    read_session_factory=make_session_factory(self.engine, read_only=True),
                    controller_defaults=self.controller_defaults,
                )
                self.scheduler.start()
            self.app = create_app(s, engine=self.engine, scheduler=self.scheduler)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_ray(self) -> None:
        from workers.cluster import ClusterError, connect, start_embedded_cluster

        s = self.settings
        try:
            if s.ray_address:
                connect(s.ray_address)
                log.info("connected to the Ray cluster at %s", s.ray_address)
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

        assert self.app is not None, "start() first"
        level = self.settings.log_level.lower()
        config = uvicorn.Config(self.app, host=host, port=port, log_level=level, access_log=level == "debug")
        return uvicorn.Server(config)

    def client_url(self, port: int | None = None) -> str:
        host = self.settings.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        return f"http://{host}:{port or self.settings.port}"

    def serve_forever(self) -> None:
        """Serve in this (main) thread until SIGINT/SIGTERM; uvicorn handles the signals."""
        self._server = self._server_for(self.settings.host, self.settings.port)
        self._server.run()

    def serve_in_thread(self, port: int | None = None, timeout_s: float = 30.0) -> str:
        """Serve in a background thread (port 0 or None = settings.port); returns the base URL."""
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


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
