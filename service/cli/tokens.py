"""`lattice token create` mints an API token directly in the database (the operator, on the server's
machine); `lattice token list` and `lattice token revoke` go through the API with the caller's token
(an admin sees every token, a user their own tenant's user tokens)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from service.cli.app import (
    Output,
    OutputOption,
    client_for,
    display_url,
    err,
    first_line,
    load_settings,
    one_line_errors,
    out,
    output_of,
    print_json,
    print_table,
)
from service.cli.client import CliError, api_path


@one_line_errors
def token_create(
    tenant: Annotated[str, typer.Option(help="Tenant the token acts for (created if new).")],
    admin: Annotated[bool, typer.Option("--admin", help="An admin token (sees all tenants).")] = False,
    description: Annotated[str | None, typer.Option(help="Label stored with the token.")] = None,
    ttl: Annotated[
        str | None, typer.Option(help="Expire after this long: a number with s, m, h, d or w (e.g. 30d).")
    ] = None,
) -> None:
    """Create an API token directly in the database (prints it once)."""
    from pydantic import ValidationError
    from sqlalchemy.exc import SQLAlchemyError  # the server's extra: only this command needs it
    from sqlalchemy.orm import Session

    from service.auth import create_token_row, parse_ttl
    from service.schemas import TokenCreate
    from service.store.prepare import prepare_database

    try:
        ttl_s = parse_ttl(ttl) if ttl is not None else None
    except ValueError as e:
        raise CliError(f"invalid --ttl: {e}") from e
    try:
        TokenCreate(tenant=tenant, admin=admin, description=description, ttl_s=ttl_s)
    except ValidationError as e:
        first = e.errors()[0]
        option = {"ttl_s": "--ttl"}.get(str(first["loc"][0]), f"--{first['loc'][0]}") if first["loc"] else ""
        detail = "must be 1 minute to 10 years" if option == "--ttl" else first["msg"]
        raise CliError(f"invalid {option}: {detail}") from e
    settings = load_settings()
    try:
        engine, _ = prepare_database(settings, bootstrap=False)
        with Session(engine) as session:
            token, row = create_token_row(
                session, tenant=tenant, admin=admin, description=description, ttl_s=ttl_s
            )
            token_id, expires = row.id, row.expires_at
            session.commit()
        engine.dispose()
    except SQLAlchemyError as e:
        raise CliError(f"cannot write the token to {display_url(settings.db_url)}: {first_line(e)}") from e
    until = f", expires {expires.isoformat(timespec='seconds')}" if expires is not None else ""
    err.print(f"{'admin' if admin else 'user'} token {token_id} for tenant {tenant}{until} (shown once):")
    out.print(token, soft_wrap=True)


def _when(value: str | None) -> str:
    return value[:19].replace("T", " ") if value else "-"


@one_line_errors
def token_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's tokens (admins).")] = None,
    output: OutputOption = Output.table,
    as_json: Annotated[bool, typer.Option("--json", help="Same as -o json.")] = False,
) -> None:
    """List API tokens (ids, tenants, expiry, last use; never the secrets)."""
    params = {"tenant": tenant} if tenant is not None else {}
    items = client_for(ctx).request("GET", "/v1/tokens", params=params)["items"]
    output = output_of(output, as_json)
    if output is Output.json:
        print_json(items)
        return
    wide = output is Output.wide
    names = ["ID", "TENANT", "ROLE", "STATUS", "EXPIRES", "LAST USED"]
    names += ["DESCRIPTION", "CREATED"] if wide else []
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in names:
        table.add_column(name, no_wrap=name not in ("TENANT", "DESCRIPTION"), overflow="fold")
    for t in items:
        row = [str(t["id"]), t["tenant"], t["role"], t["status"], _when(t["expires_at"]),
               _when(t["last_used_at"])]
        row += [t["description"] or "-", _when(t["created_at"])] if wide else []
        table.add_row(*row)
    print_table(table, wide)


@one_line_errors
def token_revoke(
    ctx: typer.Context,
    token_id: Annotated[int, typer.Argument(min=1, help="The token's id (see `lattice token list`).")],
) -> None:
    """Revoke an API token: it answers 401 from now on."""
    row = client_for(ctx).request("DELETE", api_path("tokens", str(token_id)))
    out.print(f"token {row['id']} ({row['tenant']}, {row['role']}): revoked at {_when(row['revoked_at'])}")

