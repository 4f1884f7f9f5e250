"""The job read commands: `jobs` (list), `status` (one job, `--watch` until it ends) and `events`
(the whole log, paged; `--follow` until the job ends). Each takes `-o table|wide|json`; the tables
fold a long cell onto more lines rather than cut it, and fit an 80-column terminal."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.app import (
    Output,
    OutputOption,
    client_for,
    one_line_errors,
    output_of,
    print_json,
    print_table,
)
from service.cli.client import TERMINAL, Client, job_path
from service.cli.jobs import duration, goodput_text, watch_job
from service.cli.performance_views import perf_rows

JsonFlag = Annotated[bool, typer.Option("--json", help="Same as -o json.")]
EVENTS_PAGE = 1000  # the API's largest page


def _table(names: list[str], folding: tuple[str, ...] = ()) -> Table:
    """kubectl-style columns: no box; a column folds onto more lines only if it is in `folding`,
    every other column keeps its whole text on one line."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in names:
        table.add_column(name, no_wrap=name not in folding, overflow="fold")
    return table


def _step(p: dict[str, Any]) -> str:
    return f"{p['step']}/{p['total_steps']}"


def _loss(p: dict[str, Any]) -> str:
    return "-" if p["loss"] is None else f"{p['loss']:.4f}"


def _loss_row(p: dict[str, Any]) -> str:
    """The loss, and where training diverged (the `loss_diverged` event)."""
    at = p.get("diverged_at")
    return _loss(p) if at is None else f"{_loss(p)} (diverged at step {at}: see lattice events)"


def jobs_table(items: list[dict[str, Any]], wide: bool) -> Table:
    names = ["ID", "NAME", "STATE", "STEP", "LOSS", "CREATED"]
    if wide:
        names[2:2] = ["TENANT", "PRIORITY", "ATTEMPT"]
        names += ["REASON"]
    table = _table(names, folding=("NAME", "REASON"))
    for j in items:
        p = j["progress"]
        created = j["created_at"][:16].replace("T", " ")
        row = [j["id"], j["name"], j["state"], _step(p), _loss(p), created if wide else created[5:]]
        if wide:
            row[2:2] = [j["tenant"], str(j["priority"]), str(j["attempt"])]
            row += [j.get("reason") or "-"]
        table.add_row(*row)
    return table


@one_line_errors
def jobs(
    ctx: typer.Context,
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Jobs per page.")] = 20,
    all_pages: Annotated[bool, typer.Option("--all", help="Follow every page.")] = False,
    output: OutputOption = Output.table,
    as_json: JsonFlag = False,
) -> None:
    """List jobs, newest first (-o json: the API's job objects, as a list)."""
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
    output = output_of(output, as_json)
    if output is Output.json:
        print_json(items)
        return
    print_table(jobs_table(items, output is Output.wide), output is Output.wide)


def status_table(job: dict[str, Any], wide: bool) -> Table:
    p = job["progress"]
    rows = [
        ("id", job["id"]),
        ("name", job["name"]),
        ("tenant", job["tenant"]),
        ("state", job["state"]),
        ("reason", job.get("reason") or job["state"]),
        ("priority", str(job["priority"])),
        ("attempt", str(job["attempt"])),
        ("progress", _step(p)),
        ("loss", _loss_row(p)),
        ("tokens/s", "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"),
        ("step time", duration(p.get("step_time_s"))),
        ("mfu", "-" if p.get("mfu") is None else f"{p['mfu']:.2%}"),
        ("eta", duration(p.get("eta_s"))),
        *perf_rows(job.get("performance")),
        ("time", goodput_text(p.get("goodput"))),
        ("layout", _layout_text(job.get("plan"), wide)),
        ("created", job["created_at"]),
    ]
    if wide:
        rows += [(k, str(job[k])) for k in ("started_at", "finished_at", "updated_at") if job.get(k)]
        rows.append(("digest", str((job.get("result") or {}).get("model_digest") or "-")))
        rows.append(("checkpoints", _checkpoint_text(job)))
    if job.get("error"):
        rows.append(("error", job["error"]))
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column("key", no_wrap=True, style="bold")
    table.add_column("value", overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    return table


def _checkpoint_text(job: dict[str, Any]) -> str:
    """The checkpoint period: the spec's, or the one filled in from the plan (service.checkpoint_period)."""
    period = (job.get("plan") or {}).get("checkpoint")
    if isinstance(period, dict):
        return f"{period['why']} (filled in)"
    every = ((job.get("spec") or {}).get("checkpoint") or {}).get("every_steps")
    return f"every {every} steps" if every else "at the end"


def _layout_text(plan: dict[str, Any] | None, wide: bool = False) -> str:
    layout = (plan or {}).get("layout")
    if not isinstance(layout, dict):
        return "-"
    keys = ["tp", "pp", "dp", "cp", "zero_stage"]
    if wide:
        keys += ["ep", "micro_batch_size", "num_microbatches", "schedule", "sequence_parallel", "recompute"]
    return " ".join(f"{k}={layout[k]}" for k in keys if k in layout)


def exit_code_of(job: dict[str, Any]) -> int:
    """The documented convention: a failed job is exit code 1."""
    return 1 if job["state"] == "failed" else 0


@one_line_errors
def status(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until the job ends.")] = False,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between polls with --watch.")] = 1.0,
    output: OutputOption = Output.table,
    as_json: JsonFlag = False,
) -> None:
    """Show one job; exit code 1 if it failed (with --watch: unless it succeeded)."""
    client = client_for(ctx)
    if watch:
        raise typer.Exit(watch_job(client, job_id, interval))
    job = client.request("GET", job_path(job_id))
    output = output_of(output, as_json)
    if output is Output.json:
        print_json(job)
    else:
        print_table(status_table(job, output is Output.wide), output is Output.wide)
    raise typer.Exit(exit_code_of(job))


def read_events(client: Client, job_id: str, after: int, limit: int | None) -> list[dict[str, Any]]:
    """Every event after `after` (up to `limit`), following the API's pages."""
    items: list[dict[str, Any]] = []
    while limit is None or len(items) < limit:
        size = EVENTS_PAGE if limit is None else min(EVENTS_PAGE, limit - len(items))
        page = client.request("GET", job_path(job_id, "events"), params={"after": after, "limit": size})
        items += page["items"]
        if page.get("next_after") is None or not page["items"]:
            break
        after = page["next_after"]
    return items


def _print_events(items: list[dict[str, Any]], output: Output, header: bool) -> None:
    if output is Output.json:
        return print_json(items)
    wide = output is Output.wide
    table = _table(["SEQ", "TIME", "TYPE", "PAYLOAD"], folding=("PAYLOAD",))
    table.show_header = header
    for e in items:
        when = e["time"] if wide else e["time"][5:19].replace("T", " ")
        payload = json.dumps(e["payload"], separators=(",", ":"), sort_keys=wide)
        table.add_row(str(e["seq"]), when, e["type"], payload)
    print_table(table, wide)


def follow_events(client: Client, job_id: str, after: int, output: Output, interval: float) -> int:
    """Print new events as they come until the job is terminal, then the last ones; -o json prints
    one JSON object per line. The exit code follows the job (0 succeeded, 1 otherwise)."""
    header = True
    while True:
        job = client.request("GET", job_path(job_id))
        items = read_events(client, job_id, after, None)
        if items:
            after = items[-1]["seq"]
            if output is Output.json:
                for e in items:
                    typer.echo(json.dumps(e))
            else:
                _print_events(items, output, header)
                header = False
        if job["state"] in TERMINAL:  # events read after this answer include the terminal one
            return 0 if job["state"] == "succeeded" else 1
        time.sleep(interval)


@one_line_errors
def events(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    after: Annotated[int, typer.Option(min=0, help="Only events after this seq.")] = 0,
    limit: Annotated[int | None, typer.Option(min=1, help="Most events to show (default: all).")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events until the job ends.")
    ] = False,
    interval: Annotated[float, typer.Option(min=0.01, help="Seconds between polls with --follow.")] = 1.0,
    output: OutputOption = Output.table,
    as_json: JsonFlag = False,
) -> None:
    """Show a job's event log, every page of it (-o json: a list; with --follow one object a line)."""
    client = client_for(ctx)
    output = output_of(output, as_json)
    if follow:
        raise typer.Exit(follow_events(client, job_id, after, output, interval))
    _print_events(read_events(client, job_id, after, limit), output, header=True)
