"""`lattice cluster status|cordon NODE|uncordon NODE`: the cluster as `GET /v1/cluster` shows it,
and an admin's cordon and uncordon of a node through the API."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.app import Output, OutputOption, client_for, one_line_errors, out, print_json, print_table


def _gpus(free: int | None, total: int) -> str:
    return f"{total}" if free is None else f"{free}/{total}"


def cluster_table(cluster: dict[str, Any], wide: bool) -> Table:
    names = ["NODE", "RACK", "GPUS", "HEALTH", "CORDONED", "SCHEDULABLE"]
    if wide:
        names += ["HOSTNAME", "RAY NODE", "FAULTS", "LAST FAULT"]
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in names:
        folds = name in ("NODE", "HOSTNAME", "RAY NODE", "LAST FAULT")
        table.add_column(name, no_wrap=not folds, overflow="fold")
    for n in cluster["nodes"]:
        row = [n["id"], n["rack"], _gpus(n["gpus_free"], n["gpus_total"]), n["health"],
               "yes" if n["cordoned"] else "no", "yes" if n["schedulable"] else "no"]
        if wide:
            row += [n["hostname"], n["ray_node_id"] or "-", str(n["fault_count"]), n["last_fault"] or "-"]
        table.add_row(*row)
    return table


@one_line_errors
def cluster_status(ctx: typer.Context, output: OutputOption = Output.table) -> None:
    """Show racks, nodes, free GPUs and health (GPUS is free/total with a live view)."""
    cluster = client_for(ctx).request("GET", "/v1/cluster")
    if output is Output.json:
        print_json(cluster)
        return
    free = cluster["gpus_free"]
    out.print(
        f"{cluster['source']} view, {cluster['gpu_type']}: {_gpus(free, cluster['gpus_total'])} GPUs"
        + ("" if free is None else " free") + f" on {len(cluster['nodes'])} nodes",
        highlight=False,
    )
    print_table(cluster_table(cluster, output is Output.wide), output is Output.wide)


def _set_cordon(ctx: typer.Context, node: str, action: str) -> None:
    row = client_for(ctx).request("POST", f"/v1/cluster/nodes/{node}/{action}")
    state = "cordoned" if row["cordoned"] else "not cordoned"
    out.print(f"node {row['id']}: {state} (health {row['health']}, "
              f"{'schedulable' if row['schedulable'] else 'not schedulable'})", highlight=False)


@one_line_errors
def cordon(ctx: typer.Context, node: Annotated[str, typer.Argument(help="Node name (e.g. r1-n2).")]) -> None:
    """Cordon a node (admin): it keeps what it runs but gets no new ranks."""
    _set_cordon(ctx, node, "cordon")


@one_line_errors
def uncordon(
    ctx: typer.Context, node: Annotated[str, typer.Argument(help="Node name (e.g. r1-n2).")]
) -> None:
    """Uncordon a node (admin): a cordoned, or repaired quarantined, node gets ranks again."""
    _set_cordon(ctx, node, "uncordon")
