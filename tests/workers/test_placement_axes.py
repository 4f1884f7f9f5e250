"""CP and EP groups in placement: the runs of ranks kept on one node (pure, no Ray)."""

from __future__ import annotations

import pytest

from training.config.layout import Layout
from workers.placement import place
from workers.placement_axes import axis_groups, choose_unit, group_spread, group_unit, unit_candidates
from workers.topology import Topology


def _spread(layout: Layout, topo: Topology, axis: str):
    p = place(layout, topo)
    return group_spread(layout, [r.node_id for r in p.ranks], [r.rack for r in p.ranks], axis)


def test_units_hold_whole_cp_and_ep_groups():
    assert group_unit(Layout(tp=2, cp=2, dp=4, ep=4)) == 8  # tp x lcm(2, 4)
    assert group_unit(Layout(cp=2, dp=3, ep=3)) == 6  # lcm(2, 3): 6 divides dp x cp
    assert unit_candidates(Layout(tp=2, cp=2, dp=4, ep=4)) == [8, 4, 2]
    assert unit_candidates(Layout(dp=8)) == [1]
    layout = Layout(tp=2, cp=2, dp=4, ep=4)
    for unit in unit_candidates(layout):
        for axis, size in (("cp", 2 * 2), ("ep", 2 * 4)):
            if unit % size == 0:  # every aligned run of `unit` ranks holds whole groups of the axis
                for g in axis_groups(layout, axis):
                    assert len({r // unit for r in g}) == 1


def test_ep_groups_are_the_training_engines():
    """The same groups as training.model.moe.expert_parallel_groups over each (pp, tp)'s dp x cp ranks."""
    from training.model.moe import expert_parallel_groups

    layout = Layout(tp=2, cp=2, dp=2, ep=2, pp=2, schedule="1f1b", num_microbatches=2)
    expected = []
    for pp in range(layout.pp):
        for tp in range(layout.tp):
            dp_cp = [layout.rank_of(pp, d, c, tp) for d in range(layout.dp) for c in range(layout.cp)]
            expected += expert_parallel_groups(dp_cp, layout.ep)[0]
    assert sorted(axis_groups(layout, "ep")) == sorted(expected)
    with pytest.raises(ValueError, match="axis"):
        axis_groups(layout, "dp")


def test_choose_unit_keeps_ep_groups_whole_when_the_free_gpus_allow():
    layout = Layout(dp=4, ep=4, pp=2, schedule="1f1b", num_microbatches=2)  # 8 ranks, EP groups of 4
    assert choose_unit(layout, [4, 4, 4, 4]) == (4, [])
    assert choose_unit(layout, [3, 4, 4, 3]) == (4, [])  # two whole nodes are enough
    unit, notes = choose_unit(layout, [3, 3, 3, 3])  # fragmented: fall back to single ranks
    assert unit == 1 and len(notes) == 1 and "EP group" in notes[0]
    cp_ep = Layout(tp=2, cp=2, dp=2, ep=4)  # unit 8: CP and EP groups whole
    assert choose_unit(cp_ep, [8]) == (8, [])
    unit, notes = choose_unit(cp_ep, [4, 4])  # CP groups (4 ranks) still whole, EP groups split
    assert unit == 4 and notes and "EP group" in notes[0] and not any("CP group" in n for n in notes)


def test_place_keeps_cp_and_ep_groups_in_one_node_on_the_embedded_topology():
    """place() keeps CP groups (tp x cp ranks) on one node when they fit (its unit); EP groups of
    consecutive ranks land on one node too when the nodes are free (it fills a node before the next)."""
    topo = Topology.uniform(2, 2, 4)
    cp = Layout(tp=2, cp=2, dp=2, pp=2, schedule="1f1b", num_microbatches=2)
    assert _spread(cp, topo, "cp").max_nodes == 1
    assert _spread(cp, topo, "tp").max_nodes == 1
    ep = Layout(dp=4, ep=4, pp=2, schedule="1f1b", num_microbatches=2)
    spread = _spread(ep, topo, "ep")
    assert spread.groups == 2 and spread.max_nodes == 1
    cp_ep = Layout(cp=2, dp=4, ep=4, pp=2, schedule="1f1b", num_microbatches=2)  # 16 ranks, EP = 4
    assert _spread(cp_ep, topo, "ep").max_nodes == 1 and _spread(cp_ep, topo, "cp").max_nodes == 1
    big_ep = Layout(dp=8, ep=8)  # an EP group of 8 > 4 GPUs per node: two nodes of one rack
    spread = _spread(big_ep, topo, "ep")
    assert spread.max_nodes == 2 and spread.max_racks == 1
