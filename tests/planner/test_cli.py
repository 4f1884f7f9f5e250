"""`lattice plan` through typer's CliRunner, on a small app that registers `plan_command`."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from service.cli.plan import plan_command

app = typer.Typer()
app.command("plan")(plan_command)


@app.callback()
def _root() -> None:
    """Keeps `plan` a sub-command, as in the real CLI."""


runner = CliRunner()
DEMO = [
    "plan",
    "--preset",
    "demo",
    "--global-batch",
    "8",
    "--gpus",
    "8",
    "--gpu",
    "cpu-virtual",
    "--gpus-per-node",
    "4",
]


def test_table_output_with_reasons():
    r = runner.invoke(app, DEMO)
    assert r.exit_code == 0, r.output
    assert "reasons" in r.stdout and "alternatives" in r.stdout
    assert "chosen tp=2,pp=2,dp=2" in " ".join(r.stdout.split())  # rich may wrap the line anywhere


def test_json_output_is_the_plan():
    r = runner.invoke(app, [*DEMO, "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert (body["layout"]["tp"], body["layout"]["pp"], body["layout"]["dp"]) == (2, 2, 2)
    assert body["mode"] == "search"


def test_explicit_shape_and_zero_stages():
    r = runner.invoke(
        app,
        [
            "plan",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "256",
            "--seq-len",
            "32",
            "--global-batch",
            "16",
            "--gpus",
            "8",
            "--zero-stages",
            "0,1",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["layout"]["zero_stage"] in (0, 1)


def test_layout_evaluates_instead_of_searching():
    r = runner.invoke(app, [*DEMO, "--layout", "tp=2,pp=2,dp=2,zero=1,mbs=1,m=4,schedule=1f1b,sp", "--json"])
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert body["mode"] == "evaluate"
    assert any("search's best layout" in line for line in body["reasons"])


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["plan", "--preset", "demo", "--global-batch", "8", "--gpus", "8", "--gpu", "Z100"],
            "cluster.gpu_type",
        ),
        (
            [
                "plan",
                "--layers",
                "0",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--vocab",
                "10",
                "--seq-len",
                "8",
                "--global-batch",
                "8",
                "--gpus",
                "8",
            ],
            "model.layers",
        ),
        (
            [
                "plan",
                "--layers",
                "2",
                "--hidden",
                "64",
                "--heads",
                "3",
                "--vocab",
                "10",
                "--seq-len",
                "8",
                "--global-batch",
                "8",
                "--gpus",
                "8",
            ],
            "model.heads",
        ),
        (["plan", "--preset", "demo", "--gpus", "8"], "--global-batch"),
        (["plan", "--hidden", "64", "--global-batch", "8", "--gpus", "8"], "--preset"),
        ([*DEMO, "--zero-stages", "0,x"], "--zero-stages"),
        ([*DEMO, "--layout", "tp=2,bogus=1"], "bogus"),
        ([*DEMO, "--layout", "tp=2,tp=4"], "layout.tp is given twice"),
        (["plan", "--preset", "demo", "--global-batch", "8", "--gpus", "0"], "cluster.num_gpus"),
        ([*DEMO, "--zero-stages", "7"], "--zero-stages"),
        ([*DEMO, "--precision", "x"], "train.precision"),
        ([*DEMO, "--seq-len", "-5"], "train.seq_len"),
        (["plan", "--preset", "llama3-405b", "--global-batch", "64", "--gpus", "8"], "smallest"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(args: list[str], needle: str):
    """Exit code 2 for usage (flags missing or unparsable), 1 for a model or plan that is refused."""
    r = runner.invoke(app, args)
    assert r.exit_code == (1 if needle in ("model.heads", "model.layers", "smallest") else 2)
    assert needle in r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output


def test_a_plans_layout_line_parses_back_to_the_same_layout():
    from service.planner import ClusterSpec, TrainSpec, get_preset, plan
    from service.planner.layout_text import parse_layout, parse_layout_fields
    from service.planner.result import describe

    p = plan(get_preset("llama3-405b"), TrainSpec(2048, 8192), ClusterSpec("H100-80GB", 16384))
    assert p.layout.virtual_stages > 1
    assert parse_layout(describe(p.layout)) == p.layout
    assert parse_layout_fields("tp=2,pp=2,sp") == {"tp": 2, "pp": 2, "sequence_parallel": True}


def test_gpus_left_out_come_from_the_layout_or_the_local_cluster():
    from service.planner import default_precision
    from service.settings import get_settings

    local = get_settings()
    demo = ["plan", "--preset", "demo", "--global-batch", "8", "--gpu", local.gpu_type, "--json"]
    r = runner.invoke(app, demo)
    assert r.exit_code == 0, r.output
    body = json.loads(r.stdout)
    assert body["cluster"]["num_gpus"] == local.embedded_num_gpus  # the local cluster, as a job is planned
    assert body["train"]["precision"] == default_precision(local.gpu_type)  # what a job on it trains in
    r = runner.invoke(app, ["plan", "--preset", "llama3-8b", "--global-batch", "512",
                            "--layout", "tp=8,pp=2,dp=4", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["cluster"] == {"gpu_type": "H100-80GB", "num_gpus": 64}
    r = runner.invoke(app, ["plan", "--preset", "llama3-8b", "--global-batch", "512", "--gpu", "A100-80GB"])
    assert r.exit_code == 2 and "--gpus N is required for A100-80GB" in r.stderr, r.output
