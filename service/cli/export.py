"""`lattice export JOB [--step N] [--format hf|torch] [--output DIR]`: export a job's checkpoint through
the server (`POST /v1/jobs/{id}/exports`) and wait for it. DIR is a new folder inside the server's
data root (relative to it, or absolute under it), so `model.init_from` of a later job can name it."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from service.cli.app import client_for, err, one_line_errors, out
from service.cli.client import CliError, job_path


@one_line_errors
def export(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    format: Annotated[str, typer.Option("--format", help="hf (Hugging Face Llama/Mixtral) or torch.")] = "hf",
    output: Annotated[str | None, typer.Option(help="New folder in the data root; unset = exports/.")] = None,
    step: Annotated[int | None, typer.Option(help="Checkpoint step; unset = the newest.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait until the export is written.")] = True,
    interval: Annotated[float, typer.Option(help="Seconds between status polls.")] = 0.5,
) -> None:
    """Export a checkpoint of a job to Hugging Face or torch files."""
    if format not in ("hf", "torch"):
        raise CliError(f"--format must be 'hf' or 'torch', got {format!r}")
    client = client_for(ctx)
    body: dict[str, object] = {"format": format}
    if step is not None:
        body["step"] = step
    if output is not None:
        body["output"] = output
    status = client.request("POST", job_path(job_id, "exports"), json=body)
    err.print(f"export {status['id']} of job {job_id} started: {status['output']}")
    while wait and status["state"] == "running":
        time.sleep(interval)
        status = client.request("GET", job_path(job_id, "exports", str(status["id"])))
    if status["state"] == "failed":
        raise CliError(f"export {status['id']} failed: {status.get('error')}")
    if status["state"] == "succeeded":
        out.print(f"exported step {status['step']} as {format} to {status['output']}: "
                  f"{', '.join(status['files'])}")
    else:
        out.print(f"export {status['id']} is {status['state']}")
