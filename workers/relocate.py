"""Where lost ranks go when their node must not be used again (dead, quarantined, cordoned, excluded).

Pure logic (no Ray). Tensor parallelism stays inside a node (NVLink), so a TP group that loses a rank
on such a node moves whole: its other members are replaced too (their state comes back like the lost
ranks', from DP peers or the checkpoint). Each moving group takes one schedulable node with room for
all of it, the same rack first (the pipeline and DP links keep their tier), then the node with the
most free GPUs. Lost ranks on a usable node stay in their reserved slot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from workers.placement import PlacementError, RankPlacement
from workers.topology import NodeInfo, Topology


@dataclass(frozen=True)
class Relocation:
    moves: dict[int, NodeInfo] = field(default_factory=dict)  # rank -> its new node
    partners: frozenset[int] = frozenset()  # healthy TP partners that move with a lost rank

    @property
    def ranks(self) -> list[int]:
        return sorted(self.moves)


def _tp_group(r: RankPlacement) -> tuple[int, int, int]:
    return (r.pp, r.dp, r.cp)


def relocate(lost: Collection[int], where: Sequence[RankPlacement], avoid: Collection[str],
             topology: Topology) -> Relocation:
    """New nodes for the lost ranks on avoided nodes (with their TP partners). Raises PlacementError
    when a moving group fits on no usable node."""
    bad = set(avoid)
    by_rank = {r.rank: r for r in where}
    moving = {_tp_group(by_rank[r]) for r in lost if r in by_rank and by_rank[r].node_name in bad}
    if not moving:
        return Relocation()
    free = {n.name: n.gpus_free for n in topology.schedulable_nodes(exclude=bad)}
    nodes = {n.name: n for n in topology.gpu_nodes}
    moves: dict[int, NodeInfo] = {}
    for group in sorted(moving):
        members = sorted((r for r in where if _tp_group(r) == group), key=lambda r: r.rank)
        rack = members[0].rack
        fits = [name for name, gpus in free.items() if gpus >= len(members)]
        if not fits:
            raise PlacementError(f"no usable node has {len(members)} free GPU(s) for the TP group of ranks "
                                 f"{[r.rank for r in members]} (avoiding {sorted(bad)})")
        best = min(fits, key=lambda name: (nodes[name].rack != rack, -free[name], name))
        free[best] -= len(members)
        moves.update({r.rank: nodes[best] for r in members})
    return Relocation(moves, frozenset(r for r in moves if r not in lost))


def standby_nodes(where: Sequence[RankPlacement], avoid: Collection[str],
                  topology: Topology) -> dict[str, int]:
    """Where the ranks would go if one of the job's nodes were lost now: {node id: the most ranks that
    would move there for any one node's loss}, by `relocate` itself (workers.warm_workers keeps warm
    processes there). A node whose ranks would fit nowhere adds nothing."""
    out: dict[str, int] = {}
    for name in sorted({r.node_name for r in where}):
        lost = [r.rank for r in where if r.node_name == name]
        try:
            moves = relocate(lost, where, {name, *avoid}, topology)
        except PlacementError:
            continue
        counts: dict[str, int] = {}
        for node in moves.moves.values():
            counts[node.node_id] = counts.get(node.node_id, 0) + 1
        for node_id, n in counts.items():
            out[node_id] = max(out.get(node_id, 0), n)
    return out
