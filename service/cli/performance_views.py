"""Predicted vs measured in the CLI: the `predicted` / `measured` rows of `lattice status` and the
per-term table of `lattice plan --explain-against JOB` (both from the API's `performance` of
GET /v1/jobs/{id}: service.performance)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from service.cli.client import Client, CliError, job_path


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g} ms"


def _side(side: dict[str, Any]) -> str:
    parts = [f"{_ms(side.get('step_time_s'))}/step"]
    if side.get("tokens_per_s") is not None:
        parts.append(f"{side['tokens_per_s']:,.0f} tok/s")
    if side.get("mfu") is not None:
        parts.append(f"MFU {side['mfu']:.2%}")
    return ", ".join(parts)


def perf_rows(perf: dict[str, Any] | None) -> list[tuple[str, str]]:
    """`predicted` and `measured` rows (none without a prediction)."""
    if not perf or not perf.get("predicted"):
        return []
    rows = [("predicted", _side(perf["predicted"]))]
    meas = perf.get("measured")
    if meas:
        rows.append(("measured", f"{_side(meas)} ({perf['ratio']:.2f}x predicted; median of "
                                 f"{meas.get('steps', 0)} steps after warm-up)"))
    else:
        rows.append(("measured", "- (no step after warm-up yet)"))
    return rows


def terms_table(perf: dict[str, Any]) -> Table:
    """Predicted and measured time per term, the ratio, and why a term has no measurement."""
    table = Table(title="predicted vs measured per step", header_style="bold")
    for name, justify in (("term", "left"), ("predicted", "right"), ("measured", "right"),
                          ("ratio", "right"), ("note", "left")):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for r in perf.get("terms") or []:
        table.add_row(r["name"], _ms(r.get("predicted_s")), _ms(r.get("measured_s")),
                      "-" if r.get("ratio") is None else f"{r['ratio']:.2f}x", r.get("note") or "")
    return table


def explain_against(client: Client, job_id: str) -> tuple[list[str], Table]:
    """Lines to print and the per-term table; CliError when the job has nothing measured."""
    job = client.request("GET", job_path(job_id))
    perf = job.get("performance")
    if not perf or not perf.get("measured"):
        why = "no plan" if not perf else "no measured step after warm-up"
        raise CliError(f"job {job_id} ({job['state']}) has {why} to explain")
    meas, pred = perf["measured"], perf["predicted"]
    layout = (job.get("plan") or {}).get("layout") or {}
    lines = [
        f"job {job_id} ({job['state']}): "
        + " ".join(f"{k}={layout[k]}" for k in ("tp", "pp", "dp", "cp", "zero_stage") if k in layout),
        f"predicted {_side(pred)}",
        f"measured  {_side(meas)}: {perf['ratio']:.2f}x the prediction "
        f"(median of {meas.get('steps', 0)} steps after {meas.get('warmup_steps') or 0} warm-up steps, "
        "rank 0's timers)",
    ]
    profile = perf.get("profile")
    if profile:
        lines.append(f"plan used hardware profile {profile.get('node_type')} v{profile.get('version')}")
    return lines, terms_table(perf)
