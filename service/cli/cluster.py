"""`lattice cluster status|cordon NODE|uncordon NODE|drain NODE`: the cluster as `GET /v1/cluster` shows it
(nodes, the elected scheduler, the hardware profile of each node type), and an admin's cordon and
uncordon of a node through the API. `lattice cluster up|down`: the shared
embedded cluster (workers.shared_cluster) that every role on this machine joins when
LATTICE_RAY_ADDRESS is unset."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.app import (
    Output,
    OutputOption,
    client_for,
    load_settings,
    one_line_errors,
    out,
    print_json,
    print_table,
)
from service.cli.client import CliError, api_path


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


def scheduler_line(scheduler: dict[str, Any] | None) -> str:
    """The elected scheduler as GET /v1/cluster reports it (its lease in the store)."""
    if not scheduler:
        return "scheduler: not reported by this server"
    if scheduler.get("leader") is None:
        term = scheduler.get("term") or 0
        return "scheduler: no leader" + (f" (last term {term})" if term else " (none elected yet)")
    return f"scheduler: leader {scheduler['leader']}, term {scheduler['term']}, since {scheduler['since']}"


def _num(v: float) -> str:
    """3 significant digits, without an exponent for the magnitudes profiles have (3900, not 3.9e+03)."""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _link(ar: dict[str, float] | None) -> str:
    return f"{_num(ar['gbps'])} GB/s + {_num(ar['latency_us'])} us" if ar else "-"


def inter_node_lines(profiles: list[dict[str, Any]]) -> list[str]:
    """The all-reduce between two nodes of each type that has it measured (the scheduler times it once
    a type has two nodes: service/scheduler/autocalibrate.py)."""
    return [f"{p['node_type']}: all-reduce between nodes {_link(ar)}"
            for p in profiles if (ar := p.get("inter_node_all_reduce"))]


def profiles_table(profiles: list[dict[str, Any]], wide: bool) -> Table:
    """The newest hardware profile of each node type (`lattice calibrate`, or the scheduler's
    background calibration): what plans on that node type use."""
    names = ["NODE TYPE", "VERSION", "DTYPE", "MATMUL TFLOP/S", "MEMORY GB/S", "ALL-REDUCE"]
    if wide:  # the all-reduce between two nodes too (else a line under the table: `inter_node_lines`)
        names += ["INTER-NODE", "BACKEND", "CREATED"]
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in names:
        table.add_column(name, overflow="fold", no_wrap=name in ("VERSION", "DTYPE"))
    for p in profiles:
        mm = ", ".join(f"{d} {_num(v)}" for d, v in p["matmul_tflops"].items()) or "-"
        row = [p["node_type"], f"v{p['version']}", p["compute_dtype"], mm, _num(p["memory_gbps"]),
               _link(p.get("all_reduce"))]
        if wide:
            row += [_link(p.get("inter_node_all_reduce")), p.get("backend") or "-",
                    p.get("created_at") or "-"]
        table.add_row(*row)
    return table


@one_line_errors
def cluster_status(ctx: typer.Context, output: OutputOption = Output.table) -> None:
    """Show the shared embedded cluster, the elected scheduler, racks, nodes, free GPUs and health
    (GPUS is free/total with a live view), and the hardware profile of each node type."""
    if output is not Output.json:
        out.print(shared_cluster_line(), highlight=False, soft_wrap=True)
    cluster = client_for(ctx).request("GET", "/v1/cluster")
    if output is Output.json:
        print_json(cluster)
        return
    wide = output is Output.wide
    free = cluster["gpus_free"]
    out.print(
        f"{cluster['source']} view, {cluster['gpu_type']}: {_gpus(free, cluster['gpus_total'])} GPUs"
        + ("" if free is None else " free") + f" on {len(cluster['nodes'])} nodes",
        highlight=False,
    )
    out.print(scheduler_line(cluster.get("scheduler")), highlight=False, soft_wrap=True)
    print_table(cluster_table(cluster, wide), wide)
    profiles = cluster.get("profiles") or []
    if not profiles:
        out.print("hardware profiles: none yet (plans use the catalogue's curves; `lattice calibrate` "
                  "measures one)", highlight=False, soft_wrap=True)
        return
    out.print("hardware profiles (newest per node type):", highlight=False)
    print_table(profiles_table(profiles, wide), wide)
    for line in [] if wide else inter_node_lines(profiles):
        out.print(line, highlight=False, soft_wrap=True)


def _set_cordon(ctx: typer.Context, node: str, action: str) -> None:
    row = client_for(ctx).request("POST", api_path("cluster", "nodes", node, action))
    state = "cordoned" if row["cordoned"] else "not cordoned"
    out.print(f"node {row['id']}: {state} (health {row['health']}, "
              f"{'schedulable' if row['schedulable'] else 'not schedulable'})", highlight=False)


@one_line_errors
def cordon(ctx: typer.Context, node: Annotated[str, typer.Argument(help="Node name (e.g. r1-n2).")]) -> None:
    """Cordon a node (admin): it keeps what it runs but gets no new ranks."""
    _set_cordon(ctx, node, "cordon")


@one_line_errors
def drain(ctx: typer.Context, node: Annotated[str, typer.Argument(help="Node name (e.g. r1-n2).")]) -> None:
    """Drain a node (admin): cordon it; its jobs checkpoint at the next step and move elsewhere."""
    _set_cordon(ctx, node, "drain")


@one_line_errors
def uncordon(
    ctx: typer.Context, node: Annotated[str, typer.Argument(help="Node name (e.g. r1-n2).")]
) -> None:
    """Uncordon a node (admin): a cordoned, or repaired quarantined, node gets ranks again."""
    _set_cordon(ctx, node, "uncordon")


def shared_cluster_line() -> str:
    """Whether the shared embedded cluster of this LATTICE_HOME is up (no Ray import)."""
    from workers.shared_cluster import is_up, read_address, read_state

    home = load_settings().home
    address, state = read_address(home), read_state(home)
    if address is None:
        return "embedded cluster: not running (lattice cluster up starts one)"
    if state is not None and not is_up(state):
        return f"embedded cluster: stale record of {address} (not running; lattice cluster down clears it)"
    size = f", {state.gpus} virtual GPUs on {state.nodes} nodes" if state is not None else ""
    return f"embedded cluster: up at {address}{size}"


@one_line_errors
def cluster_up(
    racks: Annotated[
        int | None, typer.Option(help="Simulated racks (default LATTICE_EMBEDDED_RACKS).")
    ] = None,
    nodes_per_rack: Annotated[
        int | None, typer.Option(help="Nodes per rack (default LATTICE_EMBEDDED_NODES_PER_RACK).")
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="Virtual GPUs per node (default LATTICE_EMBEDDED_GPUS_PER_NODE).")
    ] = None,
) -> None:
    """Start the embedded virtual-GPU Ray cluster detached and record its address under
    LATTICE_HOME; `lattice serve` (any role) joins it when LATTICE_RAY_ADDRESS is unset."""
    from service.runtime import ray_temp_dir
    from service.statefiles import PRIVATE_UMASK, private_dir
    from workers.cluster import ClusterError
    from workers.shared_cluster import start_detached

    s = load_settings()
    os.umask(PRIVATE_UMASK)  # the cluster's files are private, as under `lattice serve`
    private_dir(s.home)
    try:
        state = start_detached(
            s.home, racks=racks or s.embedded_racks,
            nodes_per_rack=nodes_per_rack or s.embedded_nodes_per_rack,
            gpus_per_node=gpus_per_node or s.embedded_gpus_per_node, temp_dir=ray_temp_dir(s.home),
        )
    except ClusterError as e:
        raise CliError(str(e)) from e
    out.print(f"embedded cluster up at {state.address}: {state.gpus} virtual GPUs on {state.nodes} nodes "
              f"(address in {s.home / 'ray_address'})", highlight=False, soft_wrap=True)


@one_line_errors
def cluster_down() -> None:
    """Stop the shared embedded cluster that `lattice cluster up` started and remove its address file."""
    from workers.shared_cluster import stop

    stopped = stop(load_settings().home)
    said = "embedded cluster stopped" if stopped else "embedded cluster: nothing was running"
    out.print(said, highlight=False)
