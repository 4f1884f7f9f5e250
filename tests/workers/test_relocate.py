"""Where lost ranks move (workers.relocate, pure logic): TP groups whole, the same rack first, then the
node with the most free GPUs; and the standby nodes the worker group keeps warm processes on, which
are exactly where `relocate` would send each node's ranks."""

from __future__ import annotations

import pytest

from workers.placement import PlacementError, RankPlacement
from workers.relocate import relocate, standby_nodes
from workers.topology import NodeInfo, Topology


def _node(name: str, rack: str, free: int, **kw: object) -> NodeInfo:
    return NodeInfo(node_id=f"id-{name}", name=name, rack=rack, gpus_total=4, gpus_free=free, **kw)  # type: ignore[arg-type]


def _ranks(layout: list[tuple[int, int, str, str]]) -> list[RankPlacement]:
    """(dp, tp, node, rack) per rank, in rank order."""
    return [RankPlacement(rank=i, pp=0, dp=dp, cp=0, tp=tp, node_id=f"id-{node}", node_name=node, rack=rack,
                          gpu=i) for i, (dp, tp, node, rack) in enumerate(layout)]


# TP 2 x DP 2 on n1 (rack A) and n2 (rack B); n3 in rack A and n4 in rack B have room.
WHERE = _ranks([(0, 0, "n1", "A"), (0, 1, "n1", "A"), (1, 0, "n2", "B"), (1, 1, "n2", "B")])
TOPOLOGY = Topology((_node("n1", "A", 2), _node("n2", "B", 2), _node("n3", "A", 2), _node("n4", "B", 4)))


def test_a_lost_rank_moves_with_its_tp_partner_to_a_node_in_its_rack() -> None:
    moves = relocate([0], WHERE, {"n1"}, TOPOLOGY)
    assert {r: n.name for r, n in moves.moves.items()} == {0: "n3", 1: "n3"}
    assert moves.partners == {1}
    assert relocate([0], WHERE, set(), TOPOLOGY).moves == {}  # its node is usable: it stays


def test_without_room_in_its_rack_the_group_takes_the_freest_node_or_fails() -> None:
    moves = relocate([0], WHERE, {"n1", "n3"}, TOPOLOGY)
    assert {n.name for n in moves.moves.values()} == {"n4"}
    with pytest.raises(PlacementError, match="no usable node has 2 free GPU"):
        relocate([0], WHERE, {"n1", "n3", "n4", "n2"}, TOPOLOGY)


def test_standby_nodes_are_where_each_nodes_ranks_would_move() -> None:
    assert standby_nodes(WHERE, set(), TOPOLOGY) == {"id-n3": 2, "id-n4": 2}
    for name, target in (("n1", "id-n3"), ("n2", "id-n4")):  # the same answer relocate gives
        lost = [r.rank for r in WHERE if r.node_name == name]
        assert {n.node_id for n in relocate(lost, WHERE, {name}, TOPOLOGY).moves.values()} == {target}


def test_standby_skips_unusable_nodes_and_groups_that_fit_nowhere() -> None:
    n3_out = _node("n3", "A", 2, health="quarantined")
    quarantined = Topology((*TOPOLOGY.nodes[:2], n3_out, TOPOLOGY.nodes[3]))
    assert standby_nodes(WHERE, set(), quarantined) == {"id-n4": 2}  # n1's pair would go to n4 too
    # n4 excluded: each replica's pair would take the other's node (2 GPUs free there)
    assert standby_nodes(WHERE, {"n4"}, quarantined) == {"id-n1": 2, "id-n2": 2}
    full = Topology((_node("n1", "A", 0), _node("n2", "B", 0), n3_out, TOPOLOGY.nodes[3]))
    assert standby_nodes(WHERE, {"n4"}, full) == {}  # nowhere left: nothing kept
    dp_only = _ranks([(0, 0, "n1", "A"), (1, 0, "n1", "A"), (2, 0, "n2", "B")])
    assert standby_nodes(dp_only, {"id-n3"}, TOPOLOGY) == {"id-n4": 2}  # the most for one node's loss
