"""`lattice tenant set|list` (admin): each tenant's GPU quota, fair-share weight, borrowing and
priority cap, through /v1/tenants. `set` sends only the options given; the others keep their values."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.app import (
    Output,
    OutputOption,
    client_for,
    one_line_errors,
    out,
    output_of,
    print_json,
    print_table,
)
from service.cli.client import api_path

tenant_app = typer.Typer(help="Tenants: GPU quota, fair-share weight, borrowing, priority cap (admin).",
                         no_args_is_help=True)


def _quota(value: int | None) -> str:
    return "none" if value is None else str(value)


def _describe(t: dict[str, Any]) -> str:
    cap = t["max_priority"] if t["max_priority"] is not None else f"default ({t['default_max_priority']})"
    return (f"tenant {t['name']}: GPU quota {_quota(t['gpu_quota'])}, weight {t['weight']:g}, "
            f"borrowing {'on' if t['borrowing'] else 'off'}, max priority {cap}")


@one_line_errors
def tenant_set(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="The tenant (created if new).")],
    quota: Annotated[int | None, typer.Option("--quota", min=0, help="GPUs its jobs may hold.")] = None,
    no_quota: Annotated[bool, typer.Option("--no-quota", help="Remove the GPU quota (no cap).")] = False,
    weight: Annotated[float | None, typer.Option(help="Fair-share weight (> 0).")] = None,
    borrowing: Annotated[
        bool | None, typer.Option("--borrowing/--no-borrowing", help="May use idle GPUs beyond its quota.")
    ] = None,
    max_priority: Annotated[int | None, typer.Option(help="Highest priority its users may set.")] = None,
    default_priority: Annotated[
        bool, typer.Option("--default-max-priority", help="Use the service's default priority cap.")
    ] = False,
) -> None:
    """Set a tenant's GPU quota, weight, borrowing or priority cap (only the options given)."""
    if quota is not None and no_quota:
        raise typer.BadParameter("give --quota or --no-quota, not both")
    if max_priority is not None and default_priority:
        raise typer.BadParameter("give --max-priority or --default-max-priority, not both")
    body: dict[str, Any] = {}
    if quota is not None or no_quota:
        body["gpu_quota"] = quota
    if weight is not None:
        body["weight"] = weight
    if borrowing is not None:
        body["borrowing"] = borrowing
    if max_priority is not None or default_priority:
        body["max_priority"] = max_priority
    if not body:
        raise typer.BadParameter("nothing to set: give --quota, --no-quota, --weight, --borrowing or "
                                 "--max-priority")
    row = client_for(ctx).request("PUT", api_path("tenants", tenant), json=body)
    out.print(_describe(row), soft_wrap=True)


@one_line_errors
def tenant_list(
    ctx: typer.Context,
    output: OutputOption = Output.table,
    as_json: Annotated[bool, typer.Option("--json", help="Same as -o json.")] = False,
) -> None:
    """List tenants with their quota, weight, borrowing and priority cap."""
    items = client_for(ctx).request("GET", "/v1/tenants")["items"]
    output = output_of(output, as_json)
    if output is Output.json:
        print_json(items)
        return
    wide = output is Output.wide
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("TENANT", "GPU QUOTA", "WEIGHT", "BORROWING", "MAX PRIORITY"):
        table.add_column(name, no_wrap=name != "TENANT", overflow="fold")
    for t in items:
        default = f"{t['default_max_priority']} (default)"
        cap = default if t["max_priority"] is None else str(t["max_priority"])
        borrowing = "yes" if t["borrowing"] else "no"
        table.add_row(t["name"], _quota(t["gpu_quota"]), f"{t['weight']:g}", borrowing, cap)
    print_table(table, wide)


tenant_app.command("set")(tenant_set)
tenant_app.command("list")(tenant_list)
