"""Placement as a pure function: hard constraints, preferences, errors, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from training.config.layout import Layout
from workers.placement import Placement, PlacementError, bundles_for, place
from workers.topology import Topology


def _layout(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1) -> Layout:
    schedule = "1f1b" if pp > 1 else "none"
    return Layout(tp=tp, pp=pp, dp=dp, cp=cp, num_microbatches=pp, schedule=schedule)


def _tp_groups_in_one_node(p: Placement, layout: Layout) -> bool:
    groups: dict[tuple[int, int, int], set[str]] = {}
    for r in p.ranks:
        groups.setdefault((r.pp, r.dp, r.cp), set()).add(r.node_id)
    return all(len(nodes) == 1 for nodes in groups.values())


def test_dp2_pp2_tp2_on_2x2x4_keeps_tp_in_node_and_spreads_stages_over_racks():
    layout = _layout(tp=2, pp=2, dp=2)
    p = place(layout, Topology.uniform(2, 2, 4))
    assert [r.rank for r in p.ranks] == list(range(8))
    assert _tp_groups_in_one_node(p, layout)
    assert p.racks_of_stage(0) != p.racks_of_stage(1)
    assert all(len(p.racks_of_stage(s)) == 1 for s in range(2))  # DP replicas of a stage share a rack
    assert p.notes == ()
    # coordinates come from Layout.coord
    for r in p.ranks:
        c = layout.coord(r.rank)
        assert (r.pp, r.dp, r.cp, r.tp) == (c.pp, c.dp, c.cp, c.tp)
    # GPU slots on a node are distinct
    slots = [(r.node_id, r.gpu) for r in p.ranks]
    assert len(set(slots)) == len(slots)


def test_four_stages_on_two_racks_are_contiguous_chunks():
    p = place(_layout(tp=2, pp=4, dp=2), Topology.uniform(2, 2, 4))
    racks = [next(iter(p.racks_of_stage(s))) for s in range(4)]
    assert racks[0] == racks[1] and racks[2] == racks[3] and racks[0] != racks[2]


def test_cordoned_and_quarantined_and_dead_nodes_are_never_used():
    topo = Topology.uniform(2, 2, 4, cordoned=["r1-n1"], health={"r2-n2": "quarantined"})
    p = place(_layout(tp=2, pp=2, dp=2), topo)
    used = {r.node_name for r in p.ranks}
    assert used == {"r1-n2", "r2-n1"}
    dead = Topology.uniform(1, 2, 4, health={"r1-n1": "dead"})
    assert {r.node_name for r in place(_layout(tp=4), dead).ranks} == {"r1-n2"}


def test_exclude_nodes_by_name_or_id():
    topo = Topology.uniform(1, 2, 4)
    assert {r.node_name for r in place(_layout(tp=2, dp=2), topo, exclude_nodes=["r1-n1"]).ranks} == {"r1-n2"}


def test_suspect_nodes_are_used_last():
    topo = Topology.uniform(1, 2, 4, health={"r1-n1": "suspect"})
    assert {r.node_name for r in place(_layout(tp=2, dp=2), topo).ranks} == {"r1-n2"}
    # ...but still used when needed
    assert {r.node_name for r in place(_layout(tp=2, dp=4), topo).ranks} == {"r1-n1", "r1-n2"}


def test_tp_larger_than_a_node_is_an_error_naming_the_node_size():
    expected = r"layout.tp=8 needs 8 GPUs within one node; the largest usable node has 4"
    with pytest.raises(PlacementError, match=expected):
        place(_layout(tp=8), Topology.uniform(2, 2, 4))


def test_not_enough_free_gpus_names_what_is_free_and_what_is_unusable():
    topo = Topology.uniform(2, 2, 4, cordoned=["r1-n1"], used={"r2-n1": 3, "r2-n2": 2})
    with pytest.raises(PlacementError) as e:
        place(_layout(tp=2, pp=2, dp=2), topo)
    msg = str(e.value)
    assert "needs 8 GPUs in groups of 2 within a node" in msg
    assert "r2-n1 1/4" in msg and "r1-n1 (cordoned)" in msg


def test_fragmented_free_gpus_do_not_fit_tp_groups():
    # 4 free GPUs in total, but one per node: a TP pair fits nowhere.
    topo = Topology.uniform(2, 2, 4, used={"r1-n1": 3, "r1-n2": 3, "r2-n1": 3, "r2-n2": 3})
    with pytest.raises(PlacementError, match="groups of 2"):
        place(_layout(tp=2, dp=2), topo)
    assert place(_layout(dp=4), topo).world_size == 4


def test_cp_group_kept_in_one_node_when_it_fits_and_split_only_when_it_must():
    layout = _layout(tp=2, cp=2, dp=2)
    p = place(layout, Topology.uniform(1, 2, 4))
    assert p.unit == 4
    for dp in range(2):
        assert len({r.node_id for r in p.ranks if r.dp == dp}) == 1
    # free 2 + 2 + 2 + 2: a CP group of 4 fits nowhere, TP pairs still whole
    tight = Topology.uniform(2, 2, 4, used={n: 2 for n in ("r1-n1", "r1-n2", "r2-n1", "r2-n2")})
    p2 = place(layout, tight)
    assert p2.unit == 2 and _tp_groups_in_one_node(p2, layout)
    assert any("CP group" in n for n in p2.notes)


def test_stage_that_no_rack_holds_spills_and_says_so():
    # One free GPU pair per rack: a stage of 4 GPUs must span racks.
    topo = Topology.uniform(2, 1, 4, used={"r1-n1": 2, "r2-n1": 2})
    p = place(_layout(tp=2, dp=2), topo)
    assert len(p.racks_of_stage(0)) == 2
    assert any("spans racks" in n for n in p.notes)


def test_placement_round_trips_and_bundles_pin_each_rank_to_its_node():
    p = place(_layout(tp=2, pp=2), Topology.uniform(2, 1, 4))
    assert Placement.from_dict(p.to_dict()) == p
    assert p.to_list()[0].keys() >= {"rank", "pp", "dp", "cp", "tp", "node_id", "rack", "gpu"}
    bundles, selectors = bundles_for(p, cpus_per_rank=0.1)
    assert bundles == [{"GPU": 1.0, "CPU": 0.1}] * 4
    assert [s["ray.io/node-id"] for s in selectors] == p.node_ids()


# ---- properties ---------------------------------------------------------------------------------

@st.composite
def _cases(draw):
    racks = draw(st.integers(1, 3))
    per_rack = draw(st.integers(1, 2))
    gpus = draw(st.sampled_from([2, 4, 8]))
    names = [f"r{r}-n{n}" for r in range(1, racks + 1) for n in range(1, per_rack + 1)]
    used = {n: draw(st.integers(0, gpus)) for n in names}
    health = {n: draw(st.sampled_from(["ready", "ready", "suspect", "quarantined", "dead"])) for n in names}
    cordoned = [n for n in names if draw(st.booleans()) and draw(st.booleans())]
    topo = Topology.uniform(racks, per_rack, gpus, health=health, cordoned=cordoned, used=used)
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 2]))
    dp = draw(st.integers(1, 3))
    pp = draw(st.integers(1, 3))
    return topo, _layout(tp=tp, pp=pp, dp=dp, cp=cp)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_cases())
def test_property_hard_constraints_hold_or_the_error_is_justified(case):
    topo, layout = case
    usable = {n.node_id: n for n in topo.schedulable_nodes()}
    # Equal-sized TP groups fit iff the free capacity counted in TP groups suffices.
    fits = sum(n.gpus_free // layout.tp for n in usable.values()) * layout.tp >= layout.world_size
    try:
        p = place(layout, topo)
    except PlacementError as e:
        assert not fits, f"placement refused a layout that fits: {e}"
        return
    assert fits
    assert [r.rank for r in p.ranks] == list(range(layout.world_size))
    assert all(r.node_id in usable for r in p.ranks)  # never an unusable node
    per_node: dict[str, int] = {}
    for r in p.ranks:
        per_node[r.node_id] = per_node.get(r.node_id, 0) + 1
    assert all(count <= usable[n].gpus_free for n, count in per_node.items())
    assert _tp_groups_in_one_node(p, layout)
    slots = [(r.node_id, r.gpu) for r in p.ranks]
    assert len(set(slots)) == len(slots)
    assert all(0 <= r.gpu < usable[r.node_id].gpus_total for r in p.ranks)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.integers(1, 2))
def test_property_on_an_empty_cluster_stages_get_their_own_rack_when_racks_allow(racks, pp, tp, dp):
    topo = Topology.uniform(racks, 2, 4)
    layout = _layout(tp=tp, pp=pp, dp=dp)
    if layout.world_size > topo.gpus_free or dp * tp > 8:
        return
    p = place(layout, topo)
    assert all(len(p.racks_of_stage(s)) == 1 for s in range(pp))  # a stage's DP replicas share a rack
    homes = [next(iter(p.racks_of_stage(s))) for s in range(pp)]
    assert len(set(homes)) == min(pp, racks)  # stages spread over as many racks as there are
    # ...in contiguous chunks: the pipeline crosses a rack boundary at most racks - 1 times
    assert sum(a != b for a, b in zip(homes, homes[1:], strict=False)) == len(set(homes)) - 1
