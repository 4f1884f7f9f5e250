"""The `lattice` Typer application: the root command and its options, the consoles, and the
one-line error handling every command shares (any failure is one line on stderr and a non-zero exit,
never a traceback). Server and token come from `--server`/`--token`, then LATTICE_SERVER /
LATTICE_TOKEN (settings), then the files `lattice serve` writes under the Lattice home."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from service.cli.client import Client, CliError
from service.settings import Settings

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

    return wrapper  # type: ignore[return-value]


def load_settings() -> Settings:
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

