"""HSDP (Layout.dp_replicate) in the planner: ZeRO-2/3 state is sharded over dp_shard = dp / dp_replicate
ranks, and the replicate groups all-reduce their gradient shards once per step (docs/planner.md)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from service.cli.plan import plan_command
from service.planner import (
    ClusterSpec,
    LayoutRefused,
    PlannerError,
    TrainSpec,
    evaluate,
    get_preset,
    plan_layout,
)
from service.planner.candidates import DEFAULT_SCHEDULES, CandidateSearch, candidate_layout, detail_for
from service.planner.costmodel import Env, Family, Stage
from service.planner.formulas import ring_bytes
from service.planner.layout_text import parse_layout
from training.config.layout import Layout

DEMO = get_preset("demo")
GPT2 = get_preset("gpt2-small")
STATE = ("params", "grads", "optimizer", "buffers")


def _demo(gpus: int, batch: int) -> tuple:
    return DEMO, TrainSpec(batch, DEMO.seq_len), ClusterSpec("cpu-virtual", gpus, 4)


def _gpt2() -> tuple:
    return GPT2, TrainSpec(64, GPT2.seq_len), ClusterSpec("H100-80GB", 16, 8)


@pytest.mark.parametrize("zero", [2, 3])
def test_state_per_rank_is_that_of_the_shard_degree(zero: int) -> None:
    """dp=4 in 2 replicas of 2 shards holds per rank what pure ZeRO on dp=2 holds (same micro-batch)."""
    hsdp = evaluate(*_demo(4, 8), Layout(dp=4, dp_replicate=2, zero_stage=zero, micro_batch_size=1,
                                         num_microbatches=2))
    pure2 = evaluate(*_demo(2, 4), Layout(dp=2, zero_stage=zero, micro_batch_size=1, num_microbatches=2))
    pure4 = evaluate(*_demo(4, 8), Layout(dp=4, zero_stage=zero, micro_batch_size=1, num_microbatches=2))
    for key in STATE + ("activations", "total"):
        assert hsdp.memory_per_gpu_bytes[key] == pytest.approx(pure2.memory_per_gpu_bytes[key], rel=1e-12)
    # ... which is more than sharding over all four ranks: the grads and optimizer shards are twice as big.
    for key in ("grads", "optimizer"):
        assert hsdp.memory_per_gpu_bytes[key] == pytest.approx(2 * pure4.memory_per_gpu_bytes[key])
    assert hsdp.memory_per_gpu_bytes["total"] > pure4.memory_per_gpu_bytes["total"]


def test_step_time_has_the_hsdp_all_reduce() -> None:
    model, train, cluster = _demo(4, 8)
    env = Env(model, train, cluster)
    hsdp, flat = (Stage(Family(env, 1, 1, 1, 4, 1, r), 1, False) for r in (2, 1))
    assert all(t > 0 for t in hsdp.hsdp_once[2:]) and hsdp.hsdp_once[:2] == [0.0, 0.0]
    assert flat.hsdp_once == [0.0] * 4 and flat.hsdp_bytes == [0.0] * 4
    lay = Layout(dp=4, dp_replicate=2, zero_stage=3, micro_batch_size=1, num_microbatches=2)
    p = evaluate(model, train, cluster, lay)
    q = evaluate(model, train, cluster, lay.with_(dp_replicate=1))
    assert "dp_replicate" not in q.comm_bytes_per_step and "dp_replicate" not in q.link_tiers
    # A ring all-reduce over the 2 replicas of the fp32 gradient shard a rank holds (1/dp_shard).
    shard = p.memory_per_gpu_bytes["grads"]
    assert p.comm_bytes_per_step["dp_replicate"] == pytest.approx(ring_bytes("all_reduce", shard, 2))
    assert p.comm_bytes_per_step["dp_replicate"] > 0
    assert sum(p.time_breakdown_s.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    assert any(r.startswith("dp_replicate=2 (HSDP)") for r in p.reasons)
    assert p.to_dict()["layout"]["dp_replicate"] == 2 and "dp_replicate" not in q.to_dict()["layout"]
    assert Layout.from_dict(p.to_dict()["layout"]) == lay


def test_shard_groups_inside_a_node_all_reduce_across_nodes() -> None:
    """16 GPUs, 8 per node: 2 replicas of 8 keep FSDP's gathers on NVLink; one all-reduce crosses nodes."""
    lay = Layout(dp=16, zero_stage=3, micro_batch_size=1, num_microbatches=4)
    flat, hsdp = (evaluate(*_gpt2(), lay.with_(dp_replicate=r)) for r in (1, 2))
    assert flat.link_tiers["dp"] == "inter-node"
    assert (hsdp.link_tiers["dp"], hsdp.link_tiers["dp_replicate"]) == ("intra-node", "inter-node")
    assert hsdp.time_breakdown_s["dp_exposed"] < flat.time_breakdown_s["dp_exposed"]


def test_dp_replicate_one_changes_nothing() -> None:
    model, train, cluster = _demo(8, 8)
    for lay in (Layout(dp=8, zero_stage=3), Layout(dp=4, tp=2, zero_stage=2, num_microbatches=2)):
        a = evaluate(model, train, cluster, lay)
        b = evaluate(model, train, cluster, Layout.from_dict({**lay.to_dict(), "dp_replicate": 1}))
        assert a.to_dict() == b.to_dict()


def test_search_candidates_keep_dp_replicate_one() -> None:
    env = Env(*_demo(8, 8))
    search = CandidateSearch(env, (0, 1, 2, 3), DEFAULT_SCHEDULES)
    search.run()
    for c in [search.best, *search.fam_best.values()]:
        assert c is not None and candidate_layout(c[3], c[4], c[5], c[1]).dp_replicate == 1


def test_partial_layout_keeps_dp_replicate() -> None:
    p = plan_layout(*_gpt2(), {"zero_stage": 3, "dp_replicate": 2})
    assert p.layout.dp_replicate == 2 and p.layout.zero_stage == 3
    assert p.layout.dp % 2 == 0 and p.layout.cp == 1
    assert p.given == {"zero_stage": 3, "dp_replicate": 2}
    assert p.reasons[0] == "kept the given zero_stage=3,dp_replicate=2; the planner chose the rest"
    # Every alternative is HSDP too, and the prediction is the same number `evaluate` gives.
    assert all(a["layout"]["dp_replicate"] == 2 for a in p.alternatives)
    assert detail_for(Env(*_gpt2()), p.layout).step_time_s == p.step_time_s
    # No ZeRO stage given: the search picks 2 or 3 (HSDP needs FSDP) and explains without crashing.
    q = plan_layout(*_gpt2(), {"dp_replicate": 2})
    assert q.layout.dp_replicate == 2 and q.layout.zero_stage in (2, 3)
    # A full HSDP layout that runs is evaluated as given.
    full = Layout(dp=16, dp_replicate=2, zero_stage=2, micro_batch_size=2, num_microbatches=2)
    r = plan_layout(*_gpt2(), full.to_dict())
    assert r.mode == "evaluate" and r.layout == full


def test_a_given_dp_replicate_that_cannot_work_is_named() -> None:
    with pytest.raises(LayoutRefused) as e:
        plan_layout(GPT2, TrainSpec(8, GPT2.seq_len), ClusterSpec("H100-80GB", 4, 4),
                    {"dp": 4, "dp_replicate": 3, "zero_stage": 3})
    msg = str(e.value)
    assert "dp_replicate (3) must divide dp (4)" in msg
    assert e.value.nearest is not None and e.value.nearest.layout.dp == 4 and "dp" in e.value.kept
    assert e.value.nearest.layout.dp_replicate == 1
    with pytest.raises(PlannerError, match="dp_replicate > 1 needs zero_stage 2 or 3"):
        plan_layout(*_gpt2(), {"dp_replicate": 2, "zero_stage": 1})


def test_cli_layout_text_with_dp_replicate() -> None:
    assert parse_layout("dp=4,zero=3,mbs=1,m=2,dp_replicate=2").dp_shard == 2
    app = typer.Typer()
    app.command("plan")(plan_command)
    app.callback()(lambda: None)
    args = ["plan", "--preset", "demo", "--global-batch", "8", "--gpus", "4", "--gpu", "cpu-virtual",
            "--gpus-per-node", "4", "--layout", "dp=4,zero=3,mbs=1,m=2,dp_replicate=2"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["mode"] == "evaluate" and out["layout"]["dp_replicate"] == 2
    assert out["comm_bytes_per_step"]["dp_replicate"] > 0
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "dp_replicate" in table.output
