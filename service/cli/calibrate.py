"""`lattice calibrate`: measure this machine (matmul and attention FLOP/s by shape, memory and
collective bandwidth) and store the result as the next version of its node type's hardware profile,
which every plan on a cluster of that node type then uses (docs/planner.md, "Efficiency curves")."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from service.cli.app import (
    Output,
    OutputOption,
    display_url,
    first_line,
    load_settings,
    one_line_errors,
    out,
    print_json,
)
from service.cli.client import CliError


def profile_table(summary: dict) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("NODE TYPE", "VERSION", "DTYPE", "MATMUL TFLOP/S", "MEMORY GB/S", "ALL-REDUCE"):
        table.add_column(name)
    mm = ", ".join(f"{d} {v:.3g}" for d, v in summary["matmul_tflops"].items())
    ar = summary.get("all_reduce")
    ar_text = f"{ar['gbps']:.3g} GB/s, {ar['latency_us']:.3g} us ({summary['backend']})" if ar else "-"
    table.add_row(summary["node_type"], str(summary["version"]), summary["compute_dtype"], mm,
                  f"{summary['memory_gbps']:.3g}", ar_text)  # fmt: skip
    return table


@one_line_errors
def calibrate(
    node_type: Annotated[
        str | None, typer.Option(help="Node type the profile is for (default: LATTICE_GPU_TYPE).")
    ] = None,
    quick: Annotated[
        bool, typer.Option(help="A reduced grid (a few seconds; for tests and smoke runs).")
    ] = False,
    save: Annotated[
        bool, typer.Option(help="Store the profile in the database (else print it only).")
    ] = True,
    output: OutputOption = Output.table,
) -> None:
    """Measure this machine and store it as the next version of its node type's hardware profile."""
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session

    from service.planner.efficiency import HardwareProfile
    from service.planner.errors import PlannerError
    from service.planner.hardware import get_gpu
    from service.store.prepare import prepare_database
    from service.store.profiles import save_profile, summarize
    from workers.calibration import calibrate_here

    settings = load_settings()
    try:
        node = get_gpu(node_type or settings.gpu_type).name
    except PlannerError as e:
        raise CliError(f"invalid --node-type: {e}") from e
    doc = calibrate_here(node, quick=quick)
    profile = HardwareProfile.from_dict(doc)
    if save:
        try:
            engine, _ = prepare_database(settings, bootstrap=False)
            with Session(engine) as session:
                profile = save_profile(session, doc)
                session.commit()
            engine.dispose()
        except SQLAlchemyError as e:
            raise CliError(
                f"cannot store the profile in {display_url(settings.db_url)}: {first_line(e)}"
            ) from e
    if output == Output.json:
        print_json(profile.to_dict())
        return
    out.print(profile_table(summarize(profile)))
    took = doc.get("meta", {}).get("seconds")
    out.print(f"measured in {took} s; " + ("stored" if save else "not stored (--no-save)"))
