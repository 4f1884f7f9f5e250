"""Which consecutive ranks placement keeps on one node, for the context and expert parallel axes.

Rank order is TP fastest, then CP, then DP (training.config.layout), and expert parallel groups are runs
of `ep` consecutive dp x cp ranks (training.parallel.mesh, training.model.moe.expert_parallel_groups). So:

- a CP group is `tp x cp` consecutive ranks, aligned;
- an EP group (one TP coordinate's ranks) lies inside `tp x ep` consecutive ranks, aligned;
- a run of `tp x lcm(cp, ep)` consecutive, aligned ranks holds whole CP groups and whole EP
  groups, and lcm(cp, ep) divides dp x cp, so such runs tile every pipeline stage.

Keeping that run on one node puts the ring and the all-to-all on NVLink, which is the tier the
planner charges when `tp x cp` (`tp x ep`) fits a node (service/planner/costmodel.py, Env.tier).
When free GPUs are too fragmented, `choose_unit` falls back to smaller runs (CP groups only, then
TP groups only) and says which preference was dropped; the rack preference of the placement then
keeps the groups inside a rack where it can.

Wiring (workers/placement.py, `place()`): replace the block that picks `unit` (from
`if cp > 1 and capacity(cp * tp) ...` to its `raise PlacementError`) with

    unit, unit_notes = choose_unit(layout, [free[n.node_id] for n in usable])
    if capacity(unit) * unit < world:
        raise PlacementError(f"needs {world} GPUs in groups of {tp} within a node; ...")
    notes.extend(unit_notes)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from training.config.layout import Layout


def group_unit(layout: Layout) -> int:
    """Consecutive ranks that hold whole CP groups and whole EP groups: tp x lcm(cp, ep)."""
    return layout.tp * math.lcm(layout.cp, layout.ep)


def unit_candidates(layout: Layout) -> list[int]:
    """Runs to keep on one node, most preferred first: CP and EP groups whole, CP groups whole,
    EP groups whole, TP groups whole (duplicates removed; each divides a pipeline stage)."""
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    out: list[int] = []
    for u in (group_unit(layout), tp * cp, tp * ep, tp):
        if u not in out:
            out.append(u)
    stage = layout.tp * layout.cp * layout.dp
    assert all(stage % u == 0 for u in out), (out, stage)
    return out


def choose_unit(layout: Layout, free_gpus_per_node: Iterable[int]) -> tuple[int, list[str]]:
    """The largest preferred run of consecutive ranks that the free GPUs can hold, node by node, and
    a note for each preference given up. Returns (tp, notes) when even that does not fit (the caller
    raises PlacementError with the free-GPU summary)."""
    free = list(free_gpus_per_node)
    world = layout.world_size
    wanted = unit_candidates(layout)
    for u in wanted:
        if sum(f // u for f in free) * u >= world:
            return u, _notes(layout, u)
    return layout.tp, _notes(layout, layout.tp)


def _notes(layout: Layout, unit: int) -> list[str]:
    notes = []
    tp = layout.tp
    if layout.cp > 1 and unit % (tp * layout.cp):
        notes.append(f"a CP group ({tp * layout.cp} GPUs) does not fit in one node; TP groups are kept whole")
    if layout.ep > 1 and unit % (tp * layout.ep):
        notes.append(
            f"an EP group spans {tp * layout.ep} consecutive ranks, more than one node can hold now; "
            "its all-to-all crosses nodes"
        )
    return notes


# ---- checking a placement ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSpread:
    axis: str  # "tp", "cp" or "ep"
    groups: int
    max_nodes: int  # most nodes one group of this axis touches
    max_racks: int


def axis_groups(layout: Layout, axis: str) -> list[list[int]]:
    """Global ranks of every group of `axis` ("tp", "cp", "ep"), from Layout.coord arithmetic."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in layout.coords():
        if axis == "tp":
            key: tuple[int, ...] = (c.pp, c.dp, c.cp)
        elif axis == "cp":
            key = (c.pp, c.dp, c.tp)
        elif axis == "ep":
            # runs of ep consecutive ranks of the flattened (dp, cp) index, per (pp, tp)
            key = (c.pp, c.tp, (c.dp * layout.cp + c.cp) // layout.ep)
        else:
            raise ValueError(f"axis must be 'tp', 'cp' or 'ep', got {axis!r}")
        groups.setdefault(key, []).append(c.rank)
    return [sorted(g) for g in groups.values()]


def group_spread(
    layout: Layout, node_of_rank: Sequence[str], rack_of_rank: Sequence[str], axis: str
) -> GroupSpread:
    """How far the groups of one axis are spread over nodes and racks in a placement."""
    groups = axis_groups(layout, axis)
    nodes = max(len({node_of_rank[r] for r in g}) for g in groups)
    racks = max(len({rack_of_rank[r] for r in g}) for g in groups)
    return GroupSpread(axis, len(groups), nodes, racks)
