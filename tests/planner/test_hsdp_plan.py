"""HSDP (Layout.dp_replicate) in the planner: ZeRO-2/3 state is sharded over dp_shard = dp / dp_replicate
ranks, and the replicate groups all-reduce their gradient shards once per step (docs/planner.md). The
search tries one split per family beside r = 1: one shard group per node (candidates.hsdp_replicas)."""

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
    plan,
    plan_layout,
)
from service.planner.candidates import (
    DEFAULT_SCHEDULES,
    CandidateSearch,
    candidate_layout,
    detail_for,
    hsdp_replicas,
)
from service.planner.costmodel import Env, Family, Micro, Stage, combine, dp_exposed
from service.planner.formulas import ring_bytes
from service.planner.layout_text import parse_layout
from service.planner.reference import reference_best
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


def _fam_best_layouts(search: CandidateSearch) -> list[Layout]:
    return [candidate_layout(c[3], c[4], c[5], c[1]) for c in [search.best, *search.fam_best.values()] if c]


def test_hsdp_split_is_one_node_per_shard_group() -> None:
    assert hsdp_replicas(8, 1, 1, 16, 1) == 2  # 8 ranks per shard group, 2 groups
    assert hsdp_replicas(8, 2, 1, 16, 1) == 4  # tp=2: 4 dp ranks fill the node
    assert hsdp_replicas(8, 1, 1, 8, 1) == 1  # the dp group is one node: plain FSDP already
    assert hsdp_replicas(8, 8, 1, 4, 1) == 1  # dp_shard would be 1: replication, ZeRO-0's job
    assert hsdp_replicas(8, 1, 1, 12, 1) == 1  # a node's 8 ranks do not divide dp=12
    assert hsdp_replicas(8, 3, 1, 16, 1) == 1  # tp does not divide the node
    assert hsdp_replicas(8, 1, 2, 16, 1) == 1 and hsdp_replicas(8, 1, 1, 16, 2) == 1  # cp, ep: no HSDP


def test_search_picks_hsdp_across_nodes() -> None:
    """gpt2-small, dp=16 over two 8-GPU nodes, ZeRO-3: one replica per node keeps FSDP's gathers on NVLink."""
    p = plan(*_gpt2(), zero_stages=(3,))
    lay = p.layout
    assert lay.dp_replicate > 1 and lay.zero_stage == 3 and lay.tp * lay.dp_shard == 8
    flat = evaluate(*_gpt2(), lay.with_(dp_replicate=1))  # the same layout without HSDP
    assert p.step_time_s < flat.step_time_s
    best_flat = plan_layout(*_gpt2(), {"dp_replicate": 1}, zero_stages=(3,))  # the best r = 1 plan
    assert best_flat.layout.dp_replicate == 1 and p.step_time_s < best_flat.step_time_s
    assert detail_for(Env(*_gpt2()), lay).step_time_s == p.step_time_s
    assert any(r.startswith(f"dp_replicate={lay.dp_replicate} (HSDP)") for r in p.reasons)
    assert any(r.startswith("dp_replicate=1 (ZeRO-3 sharded over all dp=16 ranks): ") and "slower" in r
               for r in p.reasons)
    # Over every ZeRO stage too; the unpruned reference search finds the same optimum.
    q = plan(*_gpt2())
    assert q.layout.dp_replicate > 1 and q.step_time_s == reference_best(*_gpt2())[1]
    # A partial layout that leaves dp_replicate open says why it was chosen.
    r = plan_layout(*_gpt2(), {"zero_stage": 3})
    assert r.layout == lay
    assert any(x.startswith(f"dp_replicate: chose {lay.dp_replicate} (the fastest predicted: FSDP shards")
               for x in r.reasons)


def test_one_node_keeps_dp_replicate_one() -> None:
    model, train, _ = _gpt2()
    for cluster in (ClusterSpec("H100-80GB", 8, 8), ClusterSpec("H100-80GB", 4, 8)):
        search = CandidateSearch(Env(model, train, cluster), (0, 1, 2, 3), DEFAULT_SCHEDULES)
        search.run()
        assert all(lay.dp_replicate == 1 for lay in _fam_best_layouts(search))


def test_zero_0_and_1_never_get_hsdp() -> None:
    env = Env(*_gpt2())
    search = CandidateSearch(env, (0, 1), DEFAULT_SCHEDULES)
    search.run()
    assert all(lay.dp_replicate == 1 and lay.zero_stage <= 1 for lay in _fam_best_layouts(search))
    for given in ({"zero_stage": 1}, {"zero_stage": 0}, {"zero_stage": 1, "dp": 16}):
        assert plan_layout(*_gpt2(), given).layout.dp_replicate == 1


def test_hsdp_refuses_nothing_new() -> None:
    """Searching the HSDP split adds candidates only: same families, same rejections, never slower."""
    tight = (get_preset("llama3-70b"), TrainSpec(64, 2048), ClusterSpec("H100-80GB", 16))  # memory-bound
    cases = [_gpt2(), _demo(8, 8), tight]
    for model, train, cluster in cases:
        env = Env(model, train, cluster)
        auto = CandidateSearch(env, (0, 1, 2, 3), DEFAULT_SCHEDULES)
        flat = CandidateSearch(env, (0, 1, 2, 3), DEFAULT_SCHEDULES, fixed={"dp_replicate": 1})
        auto.run()
        flat.run()
        assert auto.rejected == flat.rejected and auto.families == flat.families
        assert auto.best is not None and flat.best is not None and auto.best[0] <= flat.best[0]


def test_hsdp_all_reduce_hides_behind_one_micro_batch() -> None:
    """Like ZeRO-0's all-reduce, HSDP's needs the last micro-batch's gradients: 4 micro-batches of
    compute do not hide it (llama3-70b, 128 replicas of 2 shards across racks, no pipeline)."""
    env = Env(get_preset("llama3-70b"), TrainSpec(1024, 2048), ClusterSpec("H100-80GB", 1024))
    lay = Layout(tp=4, dp=256, zero_stage=2, micro_batch_size=1, num_microbatches=4,
                 sequence_parallel=True, dp_replicate=128)
    stage = Stage(Family(env, 4, 1, 1, 256, 1, 128), 1, False)
    combo = combine(stage, Micro(stage.fam, 1, True, "none"), lay.schedule, 4)
    total = stage.dp_once[2] + stage.hsdp_once[2] + 4 * stage.dp_per_mb[2]
    assert stage.hsdp_once[2] - combo.compute_mb > total - 4 * combo.compute_mb  # the bound binds
    exposed = stage.hsdp_once[2] - combo.compute_mb
    expected = exposed + env.gpu.overlap_slowdown * (total - exposed)
    assert dp_exposed(stage, combo, 2) == pytest.approx(expected, rel=1e-12)
    assert detail_for(env, lay).time_s["dp_exposed"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("zero", [2, 3])
def test_under_pp_the_once_per_step_collectives_are_exposed(zero: int) -> None:
    """Under PP, torch.distributed.pipelining reduce-scatters FSDP2's gradients once, after the last
    backward (REDUCE_GRAD), and HSDP's all-reduce follows it: nothing computes behind them. The
    micro-batches' own traffic (ZeRO-3's all-gathers) keeps its overlap."""
    env = Env(get_preset("llama3-70b"), TrainSpec(1024, 2048), ClusterSpec("H100-80GB", 1024))
    lay = Layout(tp=4, pp=4, dp=64, zero_stage=zero, micro_batch_size=1, num_microbatches=16,
                 schedule="interleaved_1f1b", virtual_stages=4, sequence_parallel=True, dp_replicate=32)
    stage = Stage(Family(env, 4, 1, 4, 64, 1, 32), 4, False)
    combo = combine(stage, Micro(stage.fam, 1, True, "none"), lay.schedule, 16)
    tail = stage.dp_once[zero] + stage.hsdp_once[zero]
    total = tail + 16 * stage.dp_per_mb[zero]
    assert stage.dp_once[zero] > 0 and tail > total - 16 * combo.compute_mb
    expected = tail + env.gpu.overlap_slowdown * (total - tail)
    assert dp_exposed(stage, combo, zero) == pytest.approx(expected, rel=1e-12)
    assert detail_for(env, lay).time_s["dp_exposed"] == pytest.approx(expected, rel=1e-12)
    # Per micro-batch: nothing at ZeRO-2; at ZeRO-3 the all-gathers of forward and backward (bf16),
    # whose bytes equal the one fp32 reduce-scatter's (same ring, twice the bytes per element).
    assert stage.dp_per_mb[2] == 0.0
    assert stage.dp_bytes_per_mb[3] == pytest.approx(stage.dp_bytes_once[3], rel=1e-12)
    flat = Stage(Family(env, 4, 1, 1, 256, 1, 128), 1, False)  # no pipeline: reduce-scatter per micro-batch
    assert flat.dp_bytes_once[3] == 0.0 and flat.dp_per_mb[2] > 0


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
    # dp_replicate moves to the nearest value that works with dp=4 (shard groups of one rank).
    assert e.value.nearest.layout.dp_replicate == 4 and e.value.moved == {"dp_replicate": 4}
    assert "the nearest values that work: dp_replicate=4 (given 3))" in msg
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
