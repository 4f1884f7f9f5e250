"""Partial layouts (service.planner.plan_layout): any subset of Layout's fields is kept, the rest is
filled in with a layout the engine can run; a subset no layout can keep is refused with the reason and
the nearest layout that works. The CLI and POST /v1/plans answer the same."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import typer
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from service.api.routes.plans import router
from service.cli.plan import plan_command
from service.planner import (
    ClusterSpec,
    LayoutRefused,
    PlannerError,
    TrainSpec,
    default_precision,
    get_preset,
    layout_gpus,
    plan,
    plan_layout,
)
from service.planner.fill import LAYOUT_FIELDS
from service.settings import get_settings
from training.config.layout import Layout
from training.config.spec import ModelSpec
from training.config.validate import check_layout_for_model

DEMO = get_preset("demo")
TINY = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32, name="tiny")
# (model, global batch, GPUs, GPUs per node): shapes the embedded cluster runs (cpu-virtual, 4 per node).
CASES = [
    (DEMO, 8, 8, 4),
    (DEMO, 16, 16, 4),
    (TINY, 8, 8, 4),
    (TINY, 4, 16, 4),
    (get_preset("gpt2-small"), 64, 16, 8),
]


def _specs(case: tuple) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    model, batch, gpus, per_node = case
    gpu = "cpu-virtual" if per_node == 4 else "H100-80GB"
    return model, TrainSpec(batch, model.seq_len), ClusterSpec(gpu, gpus, per_node)


@functools.cache
def _valid_layouts(i: int) -> list[Layout]:
    """The search's best layout and its alternatives: layouts known to work for case i."""
    p = plan(*_specs(CASES[i]), top_k=10)
    return [p.layout] + [Layout.from_dict(a["layout"]) for a in p.alternatives]


def _assert_runnable(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, layout: Layout) -> None:
    layout.validate()
    check_layout_for_model(model, layout)
    assert layout.global_batch == train.global_batch
    assert layout.world_size == cluster.num_gpus


@settings(derandomize=True, max_examples=80, deadline=None)
@given(
    case=st.integers(0, len(CASES) - 1),
    pick=st.integers(0, 10),
    keep=st.lists(st.booleans(), min_size=len(LAYOUT_FIELDS), max_size=len(LAYOUT_FIELDS)),
)
def test_any_subset_of_a_valid_layout_is_kept_and_runnable(case: int, pick: int, keep: list[bool]) -> None:
    layouts = _valid_layouts(case)
    source = layouts[pick % len(layouts)].to_dict()
    subset = {k: source[k] for k, kept in zip(LAYOUT_FIELDS, keep, strict=True) if kept}
    model, train, cluster = _specs(CASES[case])
    result = plan_layout(model, train, cluster, subset)
    chosen = result.layout.to_dict()
    assert {k: chosen[k] for k in subset} == subset, (subset, chosen)
    _assert_runnable(model, train, cluster, result.layout)
    assert result.given == subset


def test_the_issue_example_fills_in_and_says_what_it_chose() -> None:
    model, train, cluster = _specs(CASES[0])
    result = plan_layout(model, train, cluster, {"tp": 2, "pp": 2, "dp": 2})
    lay = result.layout
    assert (lay.tp, lay.pp, lay.dp) == (2, 2, 2)
    _assert_runnable(model, train, cluster, lay)
    assert lay.schedule != "none" and lay.num_microbatches * lay.micro_batch_size == 4
    assert result.reasons[0] == "kept the given tp=2,pp=2,dp=2; the planner chose the rest"
    assert result.mode == "fill"  # not "search" (nothing given) nor "evaluate" (as given)
    assert f"schedule: chose {lay.schedule} (pp=2 given; the fastest predicted" in "\n".join(result.reasons)
    assert any(r.startswith(f"num_microbatches: chose {lay.num_microbatches} (global batch 8 /")
               for r in result.reasons)
    assert any(r.startswith("cp: chose 1 (8 GPUs / (tp=2 given x pp=2 given x dp=2 given))")
               for r in result.reasons)
    # The job path asks for tp x pp x dp GPUs when the request names none.
    assert layout_gpus(model, {"tp": 2, "pp": 2, "dp": 2}, 8, fallback=16) == 8


def test_a_layout_that_runs_as_given_is_evaluated_exactly_as_before() -> None:
    model, train, cluster = _specs(CASES[0])
    complete = plan(model, train, cluster).layout
    result = plan_layout(model, train, cluster, complete.to_dict())
    assert result.mode == "evaluate" and result.layout == complete
    # Fields left out whose defaults already run are not re-planned (existing specs run unchanged).
    given = {"tp": 2, "dp": 2, "num_microbatches": 2}
    p = plan_layout(TINY, TrainSpec(4, 32), ClusterSpec("cpu-virtual", 4, 4), given)
    assert p.mode == "evaluate" and p.layout == Layout(tp=2, dp=2, num_microbatches=2)
    assert layout_gpus(TINY, given, 4, fallback=16) == 4


def test_auto_is_the_search() -> None:
    model, train, cluster = _specs(CASES[0])
    assert plan_layout(model, train, cluster, None).to_dict() == plan(model, train, cluster).to_dict()


@pytest.mark.parametrize(
    "given,reason,kept",
    [
        ({"tp": 4, "pp": 2}, "layout.tp (4) must divide model.kv_heads (2)", ("pp",)),
        ({"tp": 2, "pp": 2, "dp": 4}, "tp x pp x dp = 16 must divide cluster.num_gpus (8)", ("tp", "pp")),
        ({"pp": 2, "num_microbatches": 1, "schedule": "1f1b"}, "must be >= pp (2)", ("pp", "schedule")),
        ({"sequence_parallel": True, "tp": 1, "dp": 8}, "sequence_parallel needs tp > 1", ("tp", "dp")),
    ],
)
def test_an_impossible_combination_names_the_reason_and_the_nearest_layout(
    given: dict, reason: str, kept: tuple[str, ...]
) -> None:
    model, train, cluster = _specs(CASES[0])
    with pytest.raises(LayoutRefused) as info:
        plan_layout(model, train, cluster, given)
    e = info.value
    assert reason in e.reason and reason in str(e)
    assert e.kept == kept and e.nearest is not None
    nearest = e.nearest.layout
    assert all(getattr(nearest, k) == given[k] for k in kept)
    _assert_runnable(model, train, cluster, nearest)
    assert f"the nearest layout that works is {nearest.describe()}" in str(e)


@pytest.mark.parametrize("given,moved", [({"pp": 3}, {"pp": 4}), ({"dp": 5}, {"dp": 4}),
                                         ({"tp": 2, "pp": 3}, {"pp": 4}), ({"tp": 3}, {"tp": 2})])
def test_a_refused_degree_moves_to_the_nearest_value_that_works(given: dict, moved: dict) -> None:
    # The fastest layout here is TP 2 x PP 2 x DP 2, which a refusal used to suggest whatever was
    # given: pp=3 now suggests pp=4 and dp=5 dp=4. tp=4 (nearer to 3) cannot divide the 2 KV heads.
    model, train, cluster = _specs(CASES[0])
    assert (plan(model, train, cluster).layout.pp, plan(model, train, cluster).layout.dp) == (2, 2)
    with pytest.raises(LayoutRefused) as info:
        plan_layout(model, train, cluster, given)
    e = info.value
    assert e.moved == moved
    assert all(getattr(e.nearest.layout, k) == v for k, v in {**given, **moved}.items())
    _assert_runnable(model, train, cluster, e.nearest.layout)
    name, value = next(iter(moved.items()))
    assert f"the nearest values that work: {name}={value} (given {given[name]}))" in str(e)


def test_allow_unfit_completes_a_partial_layout_that_fits_nowhere_and_says_it_does_not_fit() -> None:
    # TP 2 x DP 4 at ZeRO-0 is over the cpu-virtual GPU's memory at every micro-batch and recompute.
    model, train, cluster = _specs(CASES[0])
    given = {"tp": 2, "dp": 4, "zero_stage": 0}
    with pytest.raises(LayoutRefused, match="needs .* per cpu-virtual GPU"):
        plan_layout(model, train, cluster, given)
    p = plan_layout(model, train, cluster, given, allow_unfit=True)
    assert (p.layout.tp, p.layout.dp, p.layout.pp, p.layout.zero_stage) == (2, 4, 1, 0)
    _assert_runnable(model, train, cluster, p.layout)
    assert not p.fits and p.memory_per_gpu_bytes["total"] > cluster.gpu.hbm_bytes
    assert p.given == given
    # What fits is planned as before, allowed or not.
    assert plan_layout(model, train, cluster, {"tp": 2, "pp": 4}, allow_unfit=True).layout == \
        plan_layout(model, train, cluster, {"tp": 2, "pp": 4}).layout


def test_bad_values_are_planner_errors_naming_the_field() -> None:
    model, train, cluster = _specs(CASES[0])
    for bad, field in (({"schedule": "zigzag"}, "layout.schedule"), ({"tp": 0}, "layout.tp"),
                       ({"colour": 1}, "colour"), ({"sequence_parallel": "yes"}, "layout.sequence_parallel")):
        with pytest.raises(PlannerError, match=field):
            plan_layout(model, train, cluster, bad)


# ---- the CLI and POST /v1/plans agree with the planner (and so with the job path) -------------------
_cli = typer.Typer()
_cli.command("plan")(plan_command)


@_cli.callback()
def _root() -> None:
    """Keeps `plan` a sub-command."""


DEMO_ARGS = ["plan", "--preset", "demo", "--global-batch", "8", "--gpus", "8", "--gpu", "cpu-virtual",
             "--gpus-per-node", "4", "--json"]
DEMO_BODY = {"model": {"preset": "demo"}, "global_batch": 8,
             "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8, "gpus_per_node": 4}}


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def test_cli_and_route_fill_in_the_same_layout(client: TestClient) -> None:
    # both fill in what the request leaves out as a job is planned: the precision a job on the GPU type
    # trains in and, for the service's own GPU type, its node shape
    model, train, cluster = _specs(CASES[0])
    train = dataclasses.replace(train, precision=default_precision(cluster.gpu_type))
    cluster = dataclasses.replace(cluster, nodes_per_rack=get_settings().node_shape(cluster.gpu_type)[1])
    direct = plan_layout(model, train, cluster, {"tp": 2, "pp": 2}).to_dict()
    r = CliRunner().invoke(_cli, [*DEMO_ARGS, "--layout", "tp=2,pp=2"])
    assert r.exit_code == 0, r.output
    from_cli = json.loads(r.stdout)
    http = client.post("/v1/plans", json={**DEMO_BODY, "layout": {"tp": 2, "pp": 2}})
    assert http.status_code == 200, http.text
    assert from_cli["layout"] == http.json()["layout"] == direct["layout"]
    assert from_cli["given"] == http.json()["given"] == {"tp": 2, "pp": 2}
    assert from_cli["mode"] == http.json()["mode"] == "fill"
    assert "kept the given tp=2,pp=2; the planner chose the rest" in http.json()["reasons"]


def test_cli_and_route_refuse_an_impossible_layout_with_the_nearest(client: TestClient) -> None:
    r = CliRunner().invoke(_cli, [*DEMO_ARGS, "--layout", "tp=4,pp=2"])
    assert r.exit_code != 0
    assert "must divide model.kv_heads (2)" in r.output and "nearest layout that works" in r.output
    http = client.post("/v1/plans", json={**DEMO_BODY, "layout": {"tp": 4, "pp": 2}})
    assert http.status_code == 422
    detail = http.json()["detail"]
    assert detail.startswith("layout: tp=4,pp=2 cannot work") and "nearest layout that works" in detail
