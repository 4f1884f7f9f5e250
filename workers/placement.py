"""Where each rank of a job runs: a pure function over (Layout, Topology) plus a thin Ray part.

`place()` maps every rank's coordinates (pp, dp, cp, tp) to a node and GPU slot:

- hard: a TP group is inside one node; quarantined, cordoned, dead or excluded nodes are
  never used; a node never gets more ranks than it has free GPUs;
- hard when it fits, soft otherwise: a CP group (cp x tp ranks) is inside one node;
- preferred: the DP replicas of one pipeline stage share a rack, and the pipeline stages are
  spread over racks in contiguous chunks, so the pipeline's point-to-point traffic is what
  crosses racks (ARCHITECTURE.md, "The one idea").

Ranks of one stage are consecutive (Layout orders TP fastest, then CP, DP, PP), so the
"units" kept on one node are runs of consecutive ranks. All units of a job have the same
size, so filling them greedily fails only when the free capacity counted in units is too
small; the rack preferences therefore never cost feasibility.

`reserve()` turns a Placement into one placement group for the whole job (gang): one bundle
per rank, each pinned to its node with a `ray.io/node-id` label selector.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from training.config.layout import Layout
from workers.placement_axes import choose_unit
from workers.topology import NodeInfo, Topology

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


class PlacementError(Exception):
    """The layout cannot be placed on the cluster now; the message says why."""


class ReservationTimeout(PlacementError):
    """The placement group was not granted in time (another job took the GPUs, a node left)."""


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int
    node_id: str
    node_name: str
    rack: str
    gpu: int  # intended GPU slot on the node; the actual device id is read back from the actor

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Placement:
    ranks: tuple[RankPlacement, ...]
    unit: int  # consecutive ranks kept inside one node (tp, or cp x tp when that fits)
    notes: tuple[str, ...] = ()  # soft preferences that could not be met

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def node_ids(self) -> list[str]:
        """Node id of each rank, in rank order (one placement-group bundle per rank)."""
        return [r.node_id for r in self.ranks]

    def by_node(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in self.ranks:
            out.setdefault(r.node_id, []).append(r.rank)
        return out

    def racks_of_stage(self, pp: int) -> set[str]:
        return {r.rack for r in self.ranks if r.pp == pp}

    def to_list(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.ranks]

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": self.to_list(), "unit": self.unit, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        return cls(
            ranks=tuple(RankPlacement(**r) for r in data["ranks"]),
            unit=int(data["unit"]),
            notes=tuple(data.get("notes", ())),
        )


def _free_summary(topology: Topology, usable: Sequence[NodeInfo]) -> str:
    ok = {n.node_id for n in usable}
    parts = [f"{n.name} {n.gpus_free}/{n.gpus_total}" for n in topology.gpu_nodes if n.node_id in ok]
    bad = []
    for n in topology.gpu_nodes:
        if n.node_id not in ok:
            bad.append(f"{n.name} ({n.unusable_reason() or 'excluded'})")
    text = "free: " + (", ".join(parts) if parts else "none")
    if bad:
        text += "; unusable: " + ", ".join(bad)
    return text


def _node_order_key(n: NodeInfo) -> tuple[int, str]:
    return (0 if n.health == "ready" else 1, n.name)


def _racks_for_chunks(
    chunk_units: Sequence[int], racks: Sequence[str], rack_cap: Callable[[str], int]
) -> list[str]:
    """The home rack of each chunk of pipeline stages (`chunk_units[c]` placement units), a fresh
    rack first while one has room for the whole chunk."""
    rack_of_chunk: list[str] = []
    for units in chunk_units:
        left = {r: rack_cap(r) - _reserved_units(r, rack_of_chunk, chunk_units) for r in racks}
        fresh = [r for r in racks if r not in rack_of_chunk and left[r] >= units]
        fits = fresh or [r for r in racks if left[r] >= units]
        if fits:  # best fit: the rack that holds the chunk whole with the least left over
            choice = min(fits, key=lambda r: (left[r], r))
        else:  # the chunk will spill; start it in the roomiest rack
            choice = sorted(racks, key=lambda r: (-left[r], r))[0]
        rack_of_chunk.append(choice)
    return rack_of_chunk


def place(layout: Layout, topology: Topology, *, exclude_nodes: Iterable[str] = ()) -> Placement:
    """Map every rank of `layout` to (node, rack, GPU slot) on `topology`'s free GPUs.

    `exclude_nodes` holds node ids or names to avoid on top of the unusable ones (e.g. the
    node where a rank just failed). Raises PlacementError with the reason when it cannot fit.
    """
    world = layout.world_size
    tp, cp, dp, pp = layout.tp, layout.cp, layout.dp, layout.pp
    usable = sorted(topology.schedulable_nodes(exclude_nodes), key=_node_order_key)
    free = {n.node_id: n.gpus_free for n in usable}

    def capacity(unit: int, nodes: Iterable[NodeInfo] = usable) -> int:
        return sum(free[n.node_id] // unit for n in nodes)

    largest = max((n.gpus_total for n in usable), default=0)
    if tp > largest:
        raise PlacementError(
            f"layout.tp={tp} needs {tp} GPUs within one node; the largest usable node has {largest} "
            f"({_free_summary(topology, usable)})"
        )
    notes: list[str] = []
    unit, unit_notes = choose_unit(layout, [free[n.node_id] for n in usable])
    if capacity(unit) * unit < world:
        raise PlacementError(
            f"needs {world} GPUs in groups of {tp} within a node; {_free_summary(topology, usable)}"
        )
    notes.extend(unit_notes)

    stage_size = dp * cp * tp
    units_per_stage = stage_size // unit
    nodes_by_rack: dict[str, list[NodeInfo]] = {}
    for n in usable:
        nodes_by_rack.setdefault(n.rack, []).append(n)

    def rack_cap(rack: str) -> int:
        return capacity(unit, nodes_by_rack[rack])

    # Contiguous chunks of stages, one chunk per rack, as many chunks as racks allow.
    k = max(1, min(pp, len(nodes_by_rack)))
    chunk_of_stage = [s * k // pp for s in range(pp)]
    chunk_units = [chunk_of_stage.count(c) * units_per_stage for c in range(k)]
    rack_of_chunk = _racks_for_chunks(chunk_units, list(nodes_by_rack), rack_cap)

    ranks: list[RankPlacement] = []
    used_on_node: dict[str, int] = {}
    by_id = {n.node_id: n for n in usable}
    for s in range(pp):
        home = rack_of_chunk[chunk_of_stage[s]]
        stage_nodes: list[str] = []
        remaining = units_per_stage
        for u in range(units_per_stage):
            node = _pick_node(home, nodes_by_rack, free, unit, remaining, stage_nodes)
            stage_nodes.append(node.node_id)
            remaining -= 1
            first_rank = s * stage_size + u * unit
            for r in range(first_rank, first_rank + unit):
                c = layout.coord(r)
                slot = node.gpus_total - node.gpus_free + used_on_node.get(node.node_id, 0)
                used_on_node[node.node_id] = used_on_node.get(node.node_id, 0) + 1
                ranks.append(
                    RankPlacement(
                        rank=r, pp=c.pp, dp=c.dp, cp=c.cp, tp=c.tp,
                        node_id=node.node_id, node_name=node.name, rack=node.rack, gpu=slot,
                    )
                )
            free[node.node_id] -= unit
        racks = sorted({by_id[n].rack for n in stage_nodes})
        if len(racks) > 1:
            notes.append(f"stage {s} spans racks {', '.join(racks)}: no rack had room for all its replicas")
    if len(set(rack_of_chunk)) < k:
        notes.append("pipeline stages share racks: not enough racks had room to spread them")
    assert len(ranks) == world and [r.rank for r in ranks] == list(range(world))
    return Placement(ranks=tuple(ranks), unit=unit, notes=tuple(notes))


def _reserved_units(rack: str, rack_of_chunk: Sequence[str], chunk_units: Sequence[int]) -> int:
    return sum(chunk_units[c] for c, r in enumerate(rack_of_chunk) if r == rack)


def _pick_node(
    home: str,
    nodes_by_rack: Mapping[str, Sequence[NodeInfo]],
    free: Mapping[str, int],
    unit: int,
    remaining_units: int,
    stage_nodes: Sequence[str],
) -> NodeInfo:
    """The node for the next unit of a stage: stay on the stage's current node while it has
    room; else the best-fitting node of the home rack (one that holds the rest of the stage
    with least waste, or the roomiest); spill to other racks, roomiest rack first."""
    if stage_nodes and free[stage_nodes[-1]] >= unit:
        for nodes in nodes_by_rack.values():
            for n in nodes:
                if n.node_id == stage_nodes[-1]:
                    return n
    racks = [home] + sorted(
        (r for r in nodes_by_rack if r != home),
        key=lambda r: (-sum(free[n.node_id] // unit for n in nodes_by_rack[r]), r),
    )
    for rack in racks:
        cands = [n for n in nodes_by_rack[rack] if free[n.node_id] >= unit]
        if not cands:
            continue
        whole = [n for n in cands if free[n.node_id] // unit >= remaining_units]
        if whole:
            return min(whole, key=lambda n: (n.health != "ready", free[n.node_id], n.name))
        return max(cands, key=lambda n: (n.health == "ready", free[n.node_id], n.name))
    raise AssertionError("capacity was checked before placing units")


# ---- the thin Ray part -------------------------------------------------------------------------


def bundles_for(
    placement: Placement, cpus_per_rank: float = 0.1
) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
    """One bundle per rank ({"GPU": 1, "CPU": small}) and its node-pinning label selector."""
    bundle: dict[str, float] = {"GPU": 1.0}
    if cpus_per_rank > 0:
        bundle["CPU"] = float(cpus_per_rank)
    bundles = [dict(bundle) for _ in placement.ranks]
    selectors = [{NODE_ID_LABEL: r.node_id} for r in placement.ranks]
    return bundles, selectors


def reserve(
    placement: Placement,
    *,
    name: str = "",
    cpus_per_rank: float = 0.1,
    timeout_s: float = 30.0,
    lifetime: str | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Any:
    """Gang-reserve the whole job as one placement group pinned node by node. Returns the
    ready PlacementGroup; on timeout (or when `should_stop()` turns true) the group is removed
    and ReservationTimeout is raised with what was asked for and what is free now."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles, selectors = bundles_for(placement, cpus_per_rank)
    try:
        pg = placement_group(
            bundles, strategy="PACK", name=name, lifetime=lifetime, bundle_label_selector=selectors
        )
    except Exception as e:
        raise PlacementError(f"placement group for {placement.world_size} ranks was rejected: {e}") from e
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        # Wait in slices so that a cancel does not sit out the whole timeout.
        if pg.wait(timeout_seconds=max(0.0, min(1.0, deadline - time.monotonic()))):
            log.info("placement group %s ready after %.1fs", name or pg.id.hex(), time.monotonic() - t0)
            return pg
        if should_stop is not None and should_stop():
            remove_placement_group(pg)
            raise ReservationTimeout("stopped while waiting for the placement group")
        if time.monotonic() >= deadline:
            break
    remove_placement_group(pg)
    wanted: dict[str, int] = {}
    for r in placement.ranks:
        wanted[r.node_name] = wanted.get(r.node_name, 0) + 1
    try:
        topo = Topology.from_ray(include_dead=False)
        now = ", ".join(f"{n.name} {n.gpus_free}/{n.gpus_total}" for n in topo.gpu_nodes)
    except Exception as e:  # noqa: BLE001 - the reason is best effort
        now = f"unknown ({e})"
    asked = ", ".join(f"{k} {v}" for k, v in sorted(wanted.items()))
    raise ReservationTimeout(
        f"placement group not granted within {timeout_s:.0f}s: asked GPUs {asked}; free now: {now}"
    )


def release(pg: Any) -> None:
    """Remove a placement group; harmless if it is already gone."""
    if pg is None:
        return
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as e:  # noqa: BLE001 - already removed or the cluster is gone
        log.debug("remove_placement_group: %s", e)
