"""`lattice token create`: mint an API token directly in the database."""

from __future__ import annotations

from typing import Annotated

import typer
from sqlalchemy.orm import Session

from service.cli.app import (
    display_url,
    err,
    first_line,
    load_settings,
    one_line_errors,
    out,
)
from service.cli.client import CliError
from service.store.prepare import prepare_database


@one_line_errors
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
    settings = load_settings()
    try:
        engine, _ = prepare_database(settings, bootstrap=False)
        with Session(engine) as session:
            token = create_token(session, tenant=tenant, admin=admin, description=description)
            session.commit()
        engine.dispose()
    except SQLAlchemyError as e:
        raise CliError(f"cannot write the token to {display_url(settings.db_url)}: {first_line(e)}") from e
    err.print(f"{'admin' if admin else 'user'} token for tenant {tenant} (shown once):")
    out.print(token, soft_wrap=True)

