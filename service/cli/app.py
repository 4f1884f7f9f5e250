"""The `lattice` Typer application: the root command and its options, the consoles, and the
one-line error handling every command shares (any failure is one line on stderr and a non-zero exit,
never a traceback; the exit codes are EXIT_CODES_HELP). Server and token come from `--server`/
`--token`, then LATTICE_SERVER / LATTICE_TOKEN (settings), then the files `lattice serve` writes
under the Lattice home."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from service.cli.client import Client, CliError
from service.settings import Settings

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 a request failed or the job failed (status of a failed job, a watched job "
    "that did not succeed); 2 usage (unknown flags, bad or missing arguments). Read commands take "
    "-o json (the API's JSON) or -o wide (more columns)."
)

app = typer.Typer(
    name="lattice",
    help="Lattice: plan, place, run and recover distributed training jobs.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
app.add_typer(token_app, name="token")
cluster_app = typer.Typer(help="Nodes, GPUs and health; cordon and uncordon (admin).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(fn: F) -> F:
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
        except ModuleNotFoundError as e:  # a client-only install running a command of the server's
            err.print(f"[red]error:[/red] this command needs the server's packages (missing {e.name}): "
                      "pip install 'lattice\\[server]'", soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def load_settings() -> Settings:
    try:
        return Settings()
    except ValueError as e:  # pydantic ValidationError
        first = str(e).splitlines()
        raise CliError(f"invalid LATTICE_ setting: {' '.join(first[:3])}") from e


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lattice")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"lattice {package_version()}")
        raise typer.Exit()


class Output(StrEnum):
    """`-o`: how a read command prints what it read."""

    table = "table"
    wide = "wide"
    json = "json"


OutputOption = Annotated[
    Output,
    typer.Option("--output", "-o", help="table (default), wide (more columns) or json (the API's JSON)."),
]


def output_of(output: Output, as_json: bool) -> Output:
    """`--json` is kept as a short form of `-o json`."""
    return Output.json if as_json else output


def print_json(data: Any) -> None:
    """The API's JSON as it came, never wrapped or styled, so it parses."""
    typer.echo(json.dumps(data, indent=2))


def print_table(table: Any, wide: bool, console: Console | None = None) -> None:
    """A table on `console` (default stdout): fitted to the terminal by folding the columns that
    may fold; with -o wide as wide as its cells need (lines longer than the terminal, as with
    kubectl), so no column is cut either way."""
    from rich.measure import Measurement

    console = console or out
    if not wide:
        console.print(table)
        return
    need = Measurement.get(console, console.options.update(max_width=100_000), table).maximum
    if need <= console.width:
        console.print(table)
        return
    # Console.print never renders wider than the console: a console as wide as the table, same file.
    Console(file=console.file, width=need, highlight=False, force_terminal=console.is_terminal,
            color_system=console.color_system, no_color=console.no_color).print(table)


@app.callback()
def main(
    ctx: typer.Context,
    server: Annotated[
        str | None, typer.Option(help="Server URL (else LATTICE_SERVER, else .lattice/server).")
    ] = None,
    token: Annotated[
        str | None, typer.Option(help="Bearer token (else LATTICE_TOKEN, else .lattice/token).")
    ] = None,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    ctx.obj = {"server": server, "token": token}


def display_url(url: str) -> str:
    """The database URL without its password."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return repr(url)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def client_for(ctx: typer.Context) -> Client:
    return Client.resolve(load_settings(), server=ctx.obj.get("server"), token=ctx.obj.get("token"))

