"""The `lattice` command: run the service, submit and watch jobs, manage tokens.

Server and token come from `--server`/`--token`, then LATTICE_SERVER/LATTICE_TOKEN (settings),
then the files `lattice serve` writes under the Lattice home (.lattice/server, .lattice/token).
Any failure is one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from service.cli_client import TERMINAL, Client, CliError
from service.settings import Settings, describe_settings

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

app = typer.Typer(
    name="lattice",
    help="Lattice: plan, place, run and recover distributed training jobs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")

F = TypeVar("F", bound=Callable[..., Any])


def _one_line_errors(fn: F) -> F:
    """Turn any expected failure into `error: ...` on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as e:
            err.print(f"[red]error:[/red] {e}", soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _settings() -> Settings:
    try:
        return Settings()
    except ValueError as e:  # pydantic ValidationError
        first = str(e).splitlines()
        raise CliError(f"invalid LATTICE_ setting: {' '.join(first[:3])}") from e


@app.callback()
def main(
    ctx: typer.Context,
    server: Annotated[
        str | None, typer.Option(help="Server URL (else LATTICE_SERVER, else .lattice/server).")
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="Bearer token (else LATTICE_TOKEN, else .lattice/token).")
    ] = None,
) -> None:
    ctx.obj = {"server": server, "token": token}


def _display_url(url: str) -> str:
    """The database URL without its password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return repr(url)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _client(ctx: typer.Context) -> Client:
    return Client.resolve(_settings(), server=ctx.obj.get("server"), token=ctx.obj.get("token"))


# ---- serve ---------------------------------------------------------------------------------------
def _settings_epilog() -> str:
    lines = ["Settings (environment variables):"]
    for env, default, description in describe_settings():
        lines.append(f"{env} (default {default}): {description}")
    return "\n\n".join(lines)


def prepare_database(settings: Settings, *, bootstrap: bool) -> tuple[Engine, str | None]:
    """Migrate (if enabled) and, for `serve`, create the bootstrap admin token - under one lock,
    so two processes starting at once neither migrate twice nor mint two bootstrap tokens."""
    from service.auth import ensure_bootstrap_token
    from service.store import migrate
    from service.store.db import make_engine

    engine = make_engine(settings.db_url)
    token = None
    with migrate.migration_lock(engine) as conn:
        if settings.migrate_on_start:
            migrate.upgrade_locked(conn)
        if bootstrap and settings.auth_enabled:
            with Session(bind=conn) as session:
                token = ensure_bootstrap_token(session, settings.token_path)
                session.commit()
    return engine, token


@app.command(epilog=_settings_epilog())
@_one_line_errors
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

    settings = _settings()
    updates = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = settings.model_copy(update=updates)
    configure_logging(settings)
    runtime = Runtime(settings, with_scheduler=not api_only)
    try:
        runtime.start()
    except ServiceStartError as e:
        raise CliError(str(e)) from e
    try:
        if runtime.admin_token is not None:
            out.print(f"Admin token (shown once; saved to {settings.token_path}, mode 0600):")
            out.print(runtime.admin_token, soft_wrap=True)
        settings.server_file.write_text(runtime.client_url() + "\n")
        out.print(f"Lattice listening on http://{settings.host}:{settings.port}")
        runtime.serve_forever()
    finally:
        runtime.stop()


# ---- jobs ----------------------------------------------------------------------------------------
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


@app.command()
@_one_line_errors
def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON.")],
    watch: Annotated[bool, typer.Option("--watch", help="Follow progress until the job finishes.")] = False,
    key: Annotated[str | None, typer.Option(help="Idempotency-Key (default: a fresh one).")] = None,
    interval: Annotated[float, typer.Option(help="Seconds between polls with --watch.")] = 1.0,
) -> None:
    """Submit a job from a spec file."""
    spec = load_spec_file(file)
    client = _client(ctx)
    job = client.request("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key or uuid.uuid4().hex})
    out.print(f"submitted job {job['id']} ({job['name']}): {job['state']}")
    if watch:
        raise typer.Exit(watch_job(client, job["id"], interval))


def watch_job(client: Client, job_id: str, interval: float) -> int:
    """Show a progress bar until the job finishes; 0 if it succeeded, 1 otherwise."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
    )
    failures = 0
    with Progress(*columns, console=out, transient=False) as progress:
        task = progress.add_task(job_id, total=None, loss="-", tps="-", state="")
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
            progress.update(
                task,
                total=p["total_steps"] or None,
                completed=p["step"],
                state=job["state"],
                loss=f"{p['loss']:.4f}" if p["loss"] is not None else "-",
                tps=f"{p['tokens_per_s']:.0f}" if p["tokens_per_s"] is not None else "-",
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


@app.command()
@_one_line_errors
def jobs(
    ctx: typer.Context,
    state: Annotated[list[str] | None, typer.Option(help="Only jobs in this state (repeatable).")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Jobs per page.")] = 20,
    all_pages: Annotated[bool, typer.Option("--all", help="Follow every page.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List jobs, newest first."""
    client = _client(ctx)
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


@app.command()
@_one_line_errors
def status(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show one job."""
    job = _client(ctx).request("GET", f"/v1/jobs/{job_id}")
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
        ("priority", str(job["priority"])),
        ("attempt", str(job["attempt"])),
        ("progress", f"{p['step']}/{p['total_steps']}"),
        ("loss", "-" if p["loss"] is None else f"{p['loss']:.4f}"),
        ("tokens/s", "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"),
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


@app.command()
@_one_line_errors
def cancel(ctx: typer.Context, job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """Cancel a job."""
    job = _client(ctx).request("POST", f"/v1/jobs/{job_id}/cancel")
    out.print(f"job {job['id']}: {job['state']}")


@app.command()
@_one_line_errors
def events(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    after: Annotated[int, typer.Option(min=0, help="Only events after this seq.")] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Most events to show.")] = 100,
) -> None:
    """Show a job's event log."""
    page = _client(ctx).request("GET", f"/v1/jobs/{job_id}/events", params={"after": after, "limit": limit})
    table = Table("SEQ", "TIME", "TYPE", "PAYLOAD")
    for e in page["items"]:
        table.add_row(
            str(e["seq"]), e["time"][:23], e["type"], json.dumps(e["payload"], separators=(",", ":"))
        )
    out.print(table)


# ---- tokens --------------------------------------------------------------------------------------
@token_app.command("create")
@_one_line_errors
def token_create(
    tenant: Annotated[str, typer.Option(help="Tenant the token acts for (created if new).")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin token (sees all tenants).")] = False,
    description: Annotated[str | None, typer.Option(help="Label stored with the token.")] = None,
) -> None:
    """Create an API token directly in the database (prints it once)."""
    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError

    from service.auth import create_token
    from service.schemas import TokenCreate

    try:
        TokenCreate(tenant=tenant, admin=admin, description=description)
    except ValidationError as e:
        raise CliError(f"invalid --tenant or --description: {e.errors()[0]['msg']}") from e
    settings = _settings()
    try:
        engine, _ = prepare_database(settings, bootstrap=False)
        with Session(engine) as session:
            token = create_token(session, tenant=tenant, admin=admin, description=description)
            session.commit()
        engine.dispose()
    except SQLAlchemyError as e:
        raise CliError(f"cannot write the token to {_display_url(settings.db_url)}: {_first_line(e)}") from e
    err.print(f"{'admin' if admin else 'user'} token for tenant {tenant} (shown once):")
    out.print(token, soft_wrap=True)


def _register_plan_command() -> None:
    try:
        from service.cli_plan import plan_command
    except ModuleNotFoundError as e:  # the planner's CLI is not installed in this checkout
        if e.name not in ("service.cli_plan", "service.planner"):
            raise
        return
    app.command("plan")(plan_command)


_register_plan_command()
