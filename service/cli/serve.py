"""`lattice serve`: run the service (migrations, Ray, the scheduler, the API) in this process."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from service.cli.app import (
    load_settings,
    one_line_errors,
    out,
)
from service.cli.client import CliError
from service.settings import describe_settings

ROLES = ("all", "api", "scheduler")


def bootstrap_notice(token: str, path: Path, *, terminal: bool) -> list[str]:
    """What `serve` prints about a new bootstrap admin token: the token itself only on a terminal
    (a non-terminal stdout is a log file or a collector that others may read)."""
    if terminal:
        return [f"Admin token (shown once; saved to {path}, mode 0600):", token]
    return [f"Admin token created and saved to {path} (mode 0600); not printed: stdout is not a terminal"]


def check_workers(role: str, workers: int, *, from_option: bool) -> None:
    """Several worker processes only for role api: roles all and scheduler hold the Ray driver and
    the leader lease, which belong to one process."""
    if workers > 1 and role != "api":
        given = f"--workers {workers}" if from_option else f"LATTICE_API_WORKERS={workers}"
        raise CliError(f"{given} needs --role api (role {role} runs one process: it holds the Ray driver "
                       "and the scheduler's leader lease); use --workers 1, or run more --role api replicas")


def settings_epilog() -> str:
    lines = ["Settings (environment variables):"]
    for env, default, description in describe_settings():
        lines.append(f"{env} (default {default}): {description}")
    return "\n\n".join(lines)


@one_line_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default LATTICE_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default LATTICE_PORT).")] = None,
    role: Annotated[
        str | None,
        typer.Option(
            "--role",
            help="all: API and scheduler in this process; api: HTTP only, never touches Ray (run several "
            "behind a load balancer); scheduler: admission, placement, ingest and reconciliation, no HTTP "
            "(run several: one elected leader acts, the others wait hot). Default LATTICE_ROLE (all).",
        ),
    ] = None,
    api_only: Annotated[
        bool, typer.Option("--api-only", help="The same as --role api.", hidden=True),
    ] = False,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers", min=1, max=64,
            help="Role api only: HTTP worker processes sharing the port (uvicorn's multi-process mode), "
            "each with its own database pool and load-shedding slots; /metrics sums the counters of all. "
            "About one per core. Default LATTICE_API_WORKERS (auto: one per CPU this process may use, "
            "at most 8).",
        ),
    ] = None,
) -> None:
    """Run the Lattice service: migrate the database, start (or join) the Ray cluster, run the
    scheduler, serve the API. Ctrl-C stops it; running jobs resume on the next start."""
    from service.runtime import Runtime, ServiceStartError, configure_logging
    from service.statefiles import PRIVATE_UMASK, write_private

    settings = load_settings()
    role = "api" if api_only else role
    if role is not None and role not in ROLES:
        raise CliError(f"--role must be one of {', '.join(ROLES)}, got {role!r}")
    updates = {k: v for k, v in {"host": host, "port": port, "role": role, "api_workers": workers}.items()
               if v is not None}
    settings = settings.model_copy(update=updates)
    if settings.api_workers != "auto":
        check_workers(settings.role, settings.api_workers, from_option=workers is not None)
    settings = settings.model_copy(update={"api_workers": settings.api_worker_count(settings.role)})
    configure_logging(settings)
    os.umask(PRIVATE_UMASK)  # everything the service (and its embedded Ray) creates is private
    runtime = Runtime(settings)
    try:
        runtime.start()
    except ServiceStartError as e:
        raise CliError(str(e)) from e
    try:
        if runtime.admin_token is not None:
            notice = bootstrap_notice(runtime.admin_token, settings.token_path, terminal=sys.stdout.isatty())
            for line in notice:
                out.print(line, soft_wrap=True)
        if runtime.with_http:
            write_private(settings.server_file, runtime.client_url() + "\n")
            procs = f" ({settings.api_workers} worker processes)" if runtime.workers > 1 else ""
            out.print(f"Lattice ({runtime.role}) listening on http://{settings.host}:{settings.port}{procs}")
        else:
            probes = (f"/healthz and /metrics on port {settings.scheduler_port}" if settings.scheduler_port
                      else "no HTTP")
            out.print(f"Lattice scheduler running ({probes}); it acts while it holds the leader lease")
        runtime.serve_forever()
    finally:
        runtime.stop()

