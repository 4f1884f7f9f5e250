"""`lattice plan`: choose (or evaluate) a parallel layout and print the evidence.

`plan_command` is a typer command function; service.cli registers it as `lattice plan`.
Bad input prints one line to stderr: exit code 2 for a usage error (a required flag missing, a flag
value that does not parse), 1 for a model, batch or layout the planner refuses (as the other
commands exit 1 when the server refuses a request).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from service.cli.app import client_for, one_line_errors
from service.cli.performance_views import explain_against
from service.planner import (
    ClusterSpec,
    Plan,
    PlannerError,
    TrainSpec,
    default_precision,
    get_preset,
    layout_gpus,
    plan_layout,
)
from service.planner.layout_text import parse_layout_fields
from service.settings import Settings, get_settings
from training.config.layout import LayoutError
from training.config.spec import ModelSpec, SpecError

GiB = 1024**3


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=code)


def _model(
    preset: str | None,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    ffn: int | None,
    vocab: int | None,
    seq_len: int | None,
) -> ModelSpec:
    if preset is not None:
        return get_preset(preset)
    given = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq_len}
    missing = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is None]
    if missing:
        raise PlannerError(
            f"give --preset NAME or all of --layers --hidden --heads --vocab --seq-len "
            f"(missing {' '.join(missing)})"
        )
    return ModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        seq_len=seq_len,  # type: ignore[arg-type]
        kv_heads=kv_heads,
        ffn=ffn,
    )


def _gpus_left_out(model: ModelSpec, given: dict[str, Any] | None, global_batch: int, gpu: str,
                   settings: Settings) -> int:
    """--gpus when it is not given, as a job's GPU count is filled in (service.api.operations.plan_job):
    the world size of a --layout that gives tp, pp and dp, else the local cluster's GPUs for its own GPU
    type (LATTICE_GPU_TYPE, the embedded shape); PlannerError when neither says."""
    gpus = layout_gpus(model, given, global_batch, 0) if given else 0
    if not gpus and gpu.lower() == settings.gpu_type.lower():
        gpus = settings.embedded_num_gpus
    if not gpus:
        raise PlannerError(f"--gpus N is required for {gpu} (the local cluster is {settings.gpu_type}), or a "
                           "--layout that gives tp, pp and dp")
    return gpus


def _zero_stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        stages = ()
    if not stages or len(set(stages)) != len(stages) or not set(stages) <= {0, 1, 2, 3}:
        raise PlannerError(f"--zero-stages must be a comma-separated list of distinct stages from 0,1,2,3, "
                           f"got {text!r}")
    return stages


def _fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def _render(p: Plan, console: Console) -> None:
    d = p.to_dict()
    lay = d["layout"]
    title = f"{'Evaluation' if p.mode == 'evaluate' else 'Plan'}: {d['model']} on {p.num_gpus} x {p.gpu_type}"
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("layout")
    t.add_column("value", justify="right")
    for key in (
        "tp",
        "pp",
        "dp",
        "cp",
        "ep",
        "zero_stage",
        "micro_batch_size",
        "num_microbatches",
        "schedule",
        "virtual_stages",
        "sequence_parallel",
        "recompute",
        "dp_replicate",  # in a plan's layout only under HSDP
    ):
        if key in lay:
            t.add_row(key, str(lay[key]))
    console.print(t)

    mem = Table(title="memory per GPU", show_header=False)
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    for key, value in p.memory_per_gpu_bytes.items():
        mem.add_row(key, _fmt_bytes(value))
    mem.add_row("fits", "yes" if p.fits else "[red]no[/red]")
    pred = Table(title="predicted", show_header=False)
    pred.add_column("metric")
    pred.add_column("value", justify="right")
    pred.add_row("step time", f"{p.step_time_s:.4g} s")
    pred.add_row("MFU", f"{p.mfu:.1%}")
    pred.add_row("tokens/s", f"{p.tokens_per_s:,.0f}")
    pred.add_row("TFLOP/s per GPU", f"{p.tflops_per_gpu:.1f}")
    pred.add_row("bubble", f"{p.bubble_fraction:.1%}")
    for key, value in p.comm_bytes_per_step.items():
        if value:
            pred.add_row(f"{key} bytes/step/GPU", _fmt_bytes(value))
    console.print(mem)
    console.print(pred)

    if p.alternatives:
        alt = Table(title="alternatives", show_header=True, header_style="bold")
        alt.add_column("layout")
        alt.add_column("step s", justify="right")
        alt.add_column("MFU", justify="right")
        alt.add_column("why not")
        for a in p.alternatives:
            alt.add_row(a["describe"], f"{a['step_time_s']:.4g}", f"{a['mfu']:.1%}", a["why"])
        console.print(alt)
    console.print("[bold]reasons[/bold]")
    for r in p.reasons:
        console.print(f"  - {r}", highlight=False)


@one_line_errors
def _explain_against(ctx: typer.Context, job_id: str) -> None:
    ctx.ensure_object(dict)  # the server and token flags of `lattice` (none when registered alone)
    lines, table = explain_against(client_for(ctx), job_id)
    console = Console()
    for line in lines:
        console.print(line, highlight=False)
    console.print(table)


def plan_command(
    ctx: typer.Context,
    preset: Annotated[
        str | None, typer.Option("--preset", help="model preset, e.g. llama3-70b, demo")
    ] = None,
    layers: Annotated[int | None, typer.Option("--layers")] = None,
    hidden: Annotated[int | None, typer.Option("--hidden")] = None,
    heads: Annotated[int | None, typer.Option("--heads")] = None,
    kv_heads: Annotated[int | None, typer.Option("--kv-heads")] = None,
    ffn: Annotated[int | None, typer.Option("--ffn")] = None,
    vocab: Annotated[int | None, typer.Option("--vocab")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="defaults to the model's")] = None,
    global_batch: Annotated[int | None, typer.Option("--global-batch", help="sequences per step")] = None,
    gpus: Annotated[int | None, typer.Option(
        "--gpus", help="total GPUs (default: a --layout's tp x pp x dp x cp, else the local cluster's "
        "for its GPU type)")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type, e.g. H100-80GB, cpu-virtual")] = "H100-80GB",
    gpus_per_node: Annotated[int | None, typer.Option("--gpus-per-node")] = None,
    nodes_per_rack: Annotated[int | None, typer.Option(
        "--nodes-per-rack", help="default: the local cluster's for its GPU type (LATTICE_*), else 4")] = None,
    oversubscription: Annotated[float, typer.Option("--oversubscription")] = 1.0,
    precision: Annotated[str | None, typer.Option(
        "--precision", help="fp32 | bf16_fp32_adam | bf16_fp32_master (default: what a job on --gpu "
        "trains in)")
    ] = None,
    zero_stages: Annotated[str, typer.Option("--zero-stages", help="stages the search may use")] = "0,1,2,3",
    layout: Annotated[
        str | None,
        typer.Option("--layout", help="keep these fields, e.g. tp=8,pp=4 (the planner fills in the rest)"),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", help="alternatives to show")] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="print the Plan as JSON")] = False,
    against: Annotated[str | None, typer.Option(
        "--explain-against", metavar="JOB",
        help="print a finished job's predicted and measured time per term (from the server) instead")] = None,
) -> None:
    """Choose the parallel layout for a model on a cluster; --layout keeps the fields it gives (any
    subset) and fills in the rest, or evaluates a layout that runs as given."""
    if against is not None:
        _explain_against(ctx, against)
        return
    try:  # usage: what the flags say cannot be read
        if global_batch is None:
            raise PlannerError("--global-batch N is required (sequences per optimizer step)")
        stages = _zero_stages(zero_stages)
        given = parse_layout_fields(layout) if layout is not None else None
        model = _model(preset, layers, hidden, heads, kv_heads, ffn, vocab, seq_len)
        settings = get_settings()
        if gpus is None:
            gpus = _gpus_left_out(model, given, global_batch, gpu, settings)
        per_node, per_rack = settings.node_shape(gpu)  # the local cluster's, for its own GPU type
        cluster = ClusterSpec(gpu, gpus, gpus_per_node or per_node, nodes_per_rack or per_rack,
                              oversubscription)
        train = TrainSpec(global_batch=global_batch, seq_len=seq_len or model.seq_len,
                          precision=precision or default_precision(cluster.gpu_type))
    except PlannerError as e:
        raise _fail(str(e), 2) from None
    except SpecError as e:  # a model shape that cannot work: refused like a request
        raise _fail(str(e), 1) from None
    try:
        result = plan_layout(
            model, train, cluster, given, zero_stages=stages, top_k=top_k, compare_with_search=True,
            gpus_from="--gpus",
        )
    except (PlannerError, SpecError, LayoutError) as e:
        raise _fail(str(e), 1) from None
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    _render(result, Console())
