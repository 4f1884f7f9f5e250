"""Job commands: submit (and watch), list, status, cancel, events."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from service.cli.app import (
    client_for,
    err,
    one_line_errors,
    out,
)
from service.cli.client import TERMINAL, Client, CliError


def load_spec_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise CliError(f"{path} is not valid {kind}: {' '.join(str(e).split())}") from e
    if not isinstance(data, dict):
        raise CliError(
            f"{path} must contain a job spec mapping (name, model, train, ...), got {type(data).__name__}"
        )
    return data


@one_line_errors
def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    watch: Annotated[bool, typer.Option("--watch", help="Follow progress until the job finishes.")] = False,
    key: Annotated[str | None, typer.Option(help="Idempotency-Key (default: a fresh one).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --watch.")] = 1.0,
) -> None:
    """Submit a job from a spec file."""
    spec = load_spec_file(file)
    client = client_for(ctx)
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
                job = client.request("GET", f"/v1/jobs/{job_id}")
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
def jobs(
    ctx: typer.Context,
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Jobs per page.")] = 20,
    all_pages: Annotated[bool, typer.Option("--all", help="Follow every page.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List jobs, newest first."""
    client = client_for(ctx)
    params: dict[str, Any] = {"limit": limit}
    if state:
        params["state"] = state
    items: list[dict[str, Any]] = []
    while True:
        page = client.request("GET", "/v1/jobs", params=params)
        items += page["items"]
        if not all_pages or not page["next_cursor"]:
            break
        params["cursor"] = page["next_cursor"]
    if as_json:
        out.print_json(data=items)
        return
    table = Table("ID", "NAME", "TENANT", "STATE", "STEP", "LOSS", "CREATED")
    table.columns[0].no_wrap = True
    for j in items:
        p = j["progress"]
        loss = f"{p['loss']:.4f}" if p["loss"] is not None else "-"
        table.add_row(
            j["id"],
            j["name"],
            j["tenant"],
            j["state"],
            f"{p['step']}/{p['total_steps']}",
            loss,
            j["created_at"][:16].replace("T", " "),
        )
    out.print(table)


@one_line_errors
def status(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one job."""
    job = client_for(ctx).request("GET", f"/v1/jobs/{job_id}")
    if as_json:
        out.print_json(data=job)
        return
    p = job["progress"]
    table = Table(show_header=False, box=None)
    rows = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("tenant", job["tenant"]),
        ("state", job["state"]),
        ("reason", job.get("reason") or job["state"]),
        ("priority", str(job["priority"])),
        ("attempt", str(job["attempt"])),
        ("progress", f"{p['step']}/{p['total_steps']}"),
        ("loss", "-" if p["loss"] is None else f"{p['loss']:.4f}"),
        ("tokens/s", "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"),
        ("step time", duration(p.get("step_time_s"))),
        ("mfu", "-" if p.get("mfu") is None else f"{p['mfu']:.2%}"),
        ("eta", duration(p.get("eta_s"))),
        ("time", goodput_text(p.get("goodput"))),
        ("layout", _layout_text(job.get("plan"))),
        ("created", job["created_at"]),
    ]
    if job.get("error"):
        rows.append(("error", job["error"]))
    for k, v in rows:
        table.add_row(f"[bold]{k}[/bold]", v)
    out.print(table)


def _layout_text(plan: dict[str, Any] | None) -> str:
    layout = (plan or {}).get("layout")
    if not isinstance(layout, dict):
        return "-"
    return " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "cp", "zero_stage") if k in layout)


@one_line_errors
def cancel(ctx: typer.Context, job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job."""
    job = client_for(ctx).request("POST", f"/v1/jobs/{job_id}/cancel")
    out.print(f"job {job['id']}: {job['state']}")


@one_line_errors
def events(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    after: Annotated[int, typer.Option(min=0, help="Only events after this seq.")] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Most events to show.")] = 100,
) -> None:
    """Show a job's event log."""
    params = {"after": after, "limit": limit}
    page = client_for(ctx).request("GET", f"/v1/jobs/{job_id}/events", params=params)
    table = Table("SEQ", "TIME", "TYPE", "PAYLOAD")
    for e in page["items"]:
        table.add_row(
            str(e["seq"]), e["time"][:23], e["type"], json.dumps(e["payload"], separators=(",", ":"))
        )
    out.print(table)

