"""The choice between the peer path and the checkpoint (workers.recovery_path): pure logic."""

from __future__ import annotations

from dataclasses import replace

from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec
from workers.placement import RankPlacement
from workers.recovery_path import choose

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)


def _ranks(layout: Layout) -> list[RankPlacement]:
    out, rank = [], 0
    for pp in range(layout.pp):
        for dp in range(layout.dp):
            for cp in range(layout.cp):
                for tp in range(layout.tp):
                    out.append(RankPlacement(rank=rank, pp=pp, dp=dp, cp=cp, tp=tp, node_id="n",
                                             node_name="n", rack="r", gpu=rank))
                    rank += 1
    return out


def _cfg(layout: Layout, **kw) -> RunConfig:
    return replace(RunConfig(model=SPEC, layout=layout, steps=4), **kw)


def test_each_lost_rank_takes_a_survivor_with_its_coordinates_and_sends_are_spread():
    layout = Layout(tp=2, dp=3)
    ranks = _ranks(layout)
    lost = {0, 1}  # replica 0's TP pair
    path = choose(_cfg(layout), ranks, lost, {r.rank: 7 for r in ranks if r.rank not in lost})
    assert path.path == "peer" and path.step == 7
    by = {r.rank: r for r in ranks}
    for dst, src in path.sources.items():
        assert src not in lost and by[src].tp == by[dst].tp and by[src].dp != by[dst].dp
    assert path.to_dict()["sources"] == {str(k): v for k, v in sorted(path.sources.items())}


def test_the_checkpoint_is_used_when_no_peer_can_stand_in():
    dp2 = Layout(dp=2)
    kept = {1: 5}
    cases = [
        (_cfg(Layout(dp=1)), _ranks(Layout(dp=1)), {0}, {}, "no DP replica"),
        (_cfg(Layout(dp=2, zero_stage=1)), _ranks(dp2), {0}, kept, "ZeRO-1 shards the optimizer"),
        (_cfg(dp2), _ranks(dp2), {0}, {1: None}, "kept no whole step"),
        (_cfg(Layout(dp=3)), _ranks(Layout(dp=3)), {0}, {1: 4, 2: 5}, "different steps [4, 5]"),
    ]
    for cfg, ranks, lost, kept_steps, why in cases:
        path = choose(cfg, ranks, lost, kept_steps)
        assert path.path == "checkpoint" and why in path.why, (path, why)
        assert path.sources == {}


def test_a_bf16_run_with_replicas_takes_the_peer_path():
    dp2 = Layout(dp=2)
    path = choose(_cfg(dp2, precision="bf16_fp32_adam"), _ranks(dp2), {0}, {1: 5})
    assert (path.path, path.step, path.sources) == ("peer", 5, {0: 1})


def test_a_lost_shard_with_no_survivor_and_the_switch_off_use_the_checkpoint():
    layout = Layout(pp=2, dp=2, schedule="1f1b", num_microbatches=2)
    ranks = _ranks(layout)
    lost = {0, 1}  # both replicas of pipeline stage 0
    path = choose(_cfg(layout), ranks, lost, {2: 3, 3: 3})
    assert path.path == "checkpoint" and "rank 0 has no healthy DP peer" in path.why
    off = choose(_cfg(Layout(dp=2)), _ranks(Layout(dp=2)), {0}, {1: 3}, enabled=False)
    assert off.path == "checkpoint" and off.why == "peer recovery is off"
