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


def bootstrap_notice(token: str, path: Path, *, terminal: bool) -> list[str]:
    """What `serve` prints about a new bootstrap admin token: the token itself only on a terminal
    (a non-terminal stdout is a log file or a collector that others may read)."""
    if terminal:
        return [f"Admin token (shown once; saved to {path}, mode 0600):", token]
    return [f"Admin token created and saved to {path} (mode 0600); not printed: stdout is not a terminal"]


def settings_epilog() -> str:
    lines = ["Settings (environment variables):"]
    for env, default, description in describe_settings():
        lines.append(f"{env} (default {default}): {description}")
    return "\n\n".join(lines)


@one_line_errors
def serve(
    host: Annotated[str | None, typer.Option(help="Bind address (default LATTICE_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default LATTICE_PORT).")] = None,
    api_only: Annotated[
        bool,
        typer.Option(
            "--api-only",
            help="Serve the API and the store only: no Ray, no scheduler (jobs stay pending). "
            "For extra API replicas; exactly one process runs the scheduler.",
        ),
    ] = False,
) -> None:
    """Run the Lattice service: migrate the database, start (or join) the Ray cluster, run the
    scheduler, serve the API. Ctrl-C stops it; running jobs resume on the next start."""
    from service.runtime import Runtime, ServiceStartError, configure_logging
    from service.statefiles import PRIVATE_UMASK, write_private

    settings = load_settings()
    updates = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = settings.model_copy(update=updates)
    configure_logging(settings)
    os.umask(PRIVATE_UMASK)  # everything the service (and its embedded Ray) creates is private
    runtime = Runtime(settings, with_scheduler=not api_only)
    try:
        runtime.start()
    except ServiceStartError as e:
        raise CliError(str(e)) from e
    try:
        if runtime.admin_token is not None:
            notice = bootstrap_notice(runtime.admin_token, settings.token_path, terminal=sys.stdout.isatty())
            for line in notice:
                out.print(line, soft_wrap=True)
        write_private(settings.server_file, runtime.client_url() + "\n")
        out.print(f"Lattice listening on http://{settings.host}:{settings.port}")
        runtime.serve_forever()
    finally:
        runtime.stop()

