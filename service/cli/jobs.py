"""Job commands: submit (and watch) and cancel; the read commands (jobs, status, events) are in
job_views."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.cli.app import (
    client_for,
    err,
    one_line_errors,
    out,
)
from service.cli.client import TERMINAL, Client, CliError, job_path
from service.cli.overrides import OverrideError, apply_overrides, parse_override
from service.cli.yaml_input import YamlInputError, parse_yaml


def load_spec_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise CliError(f"{path} is not UTF-8 text (byte {e.start}); a job spec is YAML or JSON") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else parse_yaml(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{path} is not valid JSON: {' '.join(str(e).split())}") from e
    except RecursionError as e:
        raise CliError(f"{path} is not valid JSON: nested too deeply") from e
    except YamlInputError as e:
        raise CliError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise CliError(
            f"{path} must contain a job spec mapping (name, model, train, ...), got {type(data).__name__}"
        )
    return data


@one_line_errors
def submit(
    ctx: typer.Context,
    file: Annotated[Path | None, typer.Argument(help="Job spec, YAML or JSON (or use --from).")] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Follow progress until the job finishes.")] = False,
    key: Annotated[str | None, typer.Option(help="Idempotency-Key (default: a fresh one).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --watch.")] = 1.0,
    from_job: Annotated[
        str | None, typer.Option("--from", help="Copy this job's stored spec instead of reading a file.")
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a spec field: dotted KEY=VALUE (YAML value), repeatable."),
    ] = None,
) -> None:
    """Submit a job from a spec file, or a copy of another job's spec (--from JOB), with --set
    overrides (e.g. --set train.steps=2000)."""
    if (file is None) == (from_job is None):
        err.print("[red]error:[/red] give a spec FILE or --from JOB (exactly one)", soft_wrap=True)
        raise typer.Exit(2)
    try:
        for item in sets or []:
            parse_override(item)  # a malformed --set is a usage error before anything is read
        spec = load_spec_file(file) if file is not None else None
        client = client_for(ctx)
        if spec is None:
            spec = client.request("GET", job_path(from_job))["spec"]
        spec = apply_overrides(spec, sets or [])
    except OverrideError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    job = client.request("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key or uuid.uuid4().hex})
    out.print(f"submitted job {job['id']} ({job['name']}): {job['state']}")
    if watch:
        raise typer.Exit(watch_job(client, job["id"], interval))


def watch_job(client: Client, job_id: str, interval: float) -> int:
    """Show a progress bar until the job finishes, and the job's reason each time it changes; 0 if
    it succeeded, 1 otherwise. Fits an 80-column terminal."""
    columns = (
        TextColumn("[bold]{task.fields[state]:<10}"),
        BarColumn(bar_width=12),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("eta {task.fields[eta]}"),
        TimeElapsedColumn(),
    )
    failures, reason = 0, None
    with Progress(*columns, console=out, transient=False) as progress:
        task = progress.add_task(job_id, total=None, loss="-", tps="-", state="", eta="-")
        while True:
            try:
                job = client.request("GET", job_path(job_id))
                failures = 0
            except CliError:
                failures += 1
                if failures >= 10:
                    raise
                time.sleep(interval)
                continue
            p = job["progress"]
            if job.get("reason") and job["reason"] != reason and job["state"] not in TERMINAL:
                reason = job["reason"]
                progress.console.print(f"{job_id}: {reason}", markup=False, highlight=False)
            progress.update(
                task,
                total=p["total_steps"] or None,
                completed=p["step"],
                state=job["state"],
                loss=f"{p['loss']:.4f}" if p["loss"] is not None else "-",
                tps=f"{p['tokens_per_s']:.0f}" if p["tokens_per_s"] is not None else "-",
                eta=duration(p.get("eta_s")),
            )
            if job["state"] in TERMINAL:
                break
            time.sleep(interval)
    if job["state"] == "succeeded":
        digest = (job.get("result") or {}).get("model_digest")
        out.print(f"job {job_id} succeeded" + (f" (model digest {digest})" if digest else ""))
        return 0
    err.print(f"[red]job {job_id} {job['state']}[/red]" + (f": {job['error']}" if job.get("error") else ""))
    return 1


def duration(seconds: float | None) -> str:
    """12.3s, 4m05s, 2h07m; "-" for none."""
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"
    return f"{int(seconds) // 3600}h{int(seconds) % 3600 // 60:02d}m"


def goodput_text(goodput: dict[str, Any] | None) -> str:
    """Where the time went, largest first, parts that took no time left out."""
    names = {"useful_s": "useful", "startup_s": "startup", "queued_s": "queued",
             "restarting_s": "restarting", "lost_s": "lost", "checkpoint_s": "checkpoint"}
    parts = sorted(((v, names[k]) for k, v in (goodput or {}).items() if k in names and v), reverse=True)
    return ", ".join(f"{name} {duration(v)}" for v, name in parts) or "-"


@one_line_errors
def cancel(ctx: typer.Context, job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job."""
    job = client_for(ctx).request("POST", job_path(job_id, "cancel"))
    out.print(f"job {job['id']}: {job['state']}")


@one_line_errors
def resume(ctx: typer.Context, job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Resume a failed or cancelled job from its last verified checkpoint (a new attempt)."""
    job = client_for(ctx).request("POST", job_path(job_id, "resume"))
    out.print(f"job {job['id']}: {job.get('reason') or job['state']} (attempt {job['attempt']})",
              markup=False, highlight=False)
