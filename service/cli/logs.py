"""`lattice logs JOB`: a rank's output (stdout, stderr, logging) in one attempt, as the ranks wrote it."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from service.cli.app import Output, OutputOption, client_for, one_line_errors, out, print_json
from service.cli.client import job_path
from workers.logs import ranges


@one_line_errors
def logs(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="Job id.")],
    rank: Annotated[int, typer.Option("--rank", "-r", min=0, help="Rank whose output to show.")] = 0,
    attempt: Annotated[
        int | None, typer.Option("--attempt", "-a", min=1, help="Attempt (1-based); default the latest.")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing what the rank writes until the job ends.")
    ] = False,
    tail: Annotated[int | None, typer.Option("--tail", "-n", min=1, help="Only the last N lines.")] = None,
    list_logs: Annotated[
        bool, typer.Option("--list", help="List the attempts and ranks that have logs instead.")
    ] = False,
    output: OutputOption = Output.table,
) -> None:
    """Print a rank's output in one attempt of a job (rank 0 of the latest attempt by default);
    -o applies to --list (the output itself is printed as written)."""
    client = client_for(ctx)
    if list_logs:
        index = client.request("GET", job_path(job, "logs", "index"))
        if output is Output.json:
            print_json(index)
        else:
            show_index(index)
        return
    params: dict[str, Any] = {"rank": rank, "follow": follow}
    if attempt is not None:
        params["attempt"] = attempt
    if tail is not None:
        params["tail"] = tail
    for chunk in client.stream_text(job_path(job, "logs"), params, follow=follow):
        typer.echo(chunk, nl=False)  # as written: no markup, no wrapping


def show_index(index: dict[str, Any]) -> None:
    if not index["attempts"]:
        out.print(f"job {index['job_id']} ({index['state']}) has no logs yet")
        return
    table = Table(title=f"logs of job {index['job_id']} ({index['state']})")
    for name in ("ATTEMPT", "RANKS", "BYTES"):
        table.add_column(name, no_wrap=True, justify="right" if name == "BYTES" else "left")
    for a in index["attempts"]:
        ranks = [r["rank"] for r in a["ranks"]]
        table.add_row(str(a["attempt"]), ranges(ranks), str(sum(r["bytes"] for r in a["ranks"])))
    out.print(table)


