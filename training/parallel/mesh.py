"""The one owner of the device mesh: Layout + world size -> DeviceMesh(pp, dp, cp, tp).

Rank order is the Layout's (TP fastest-varying, then CP, DP, PP), so a TP group is a run of
consecutive ranks. Everything else asks `ParallelDims` for a sub-mesh or a process group and
never recomputes rank arithmetic. Degenerate size-1 dimensions are kept (their groups are
single-rank), so code can always ask for `dims.group("dp")`.

Derived dimensions (built only when cp > 1 or ep > 1, so dense layouts create no extra groups):

    dp_cp   dp x cp flattened (torchtitan's dp_shard_cp): every rank holding the same dense
            weights; dense gradients are averaged and ZeRO/FSDP shard over it.
    ep      runs of `ep` consecutive dp_cp ranks: one MoE layer's experts are split over them
            and tokens are exchanged with all-to-all (training/model/moe.py, expert_parallel_groups).
    edp     expert data parallel: the dp_cp ranks with the same ep index, which hold the same
            experts (dp x cp / ep of them); expert gradients are reduced over it.
    dp_replicate, dp_shard   (only when layout.dp_replicate > 1, ZeRO-2/3, cp = ep = 1: HSDP) the dp
            mesh unflattened to (dp_replicate, dp_shard), shard fastest-varying: FSDP shards over
            dp_shard and all-reduces across dp_replicate, whose ranks hold the same local shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.config.layout import MESH_DIMS, Layout, LayoutError, RankCoord

DERIVED_DIMS: tuple[str, ...] = ("dp_cp", "ep", "edp", "dp_replicate", "dp_shard", "fsdp")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The 4-D mesh ("pp", "dp", "cp", "tp") over the whole default process group."""
    world = dist.get_world_size()
    layout.check_world_size(world)
    mesh = init_device_mesh(device_type, layout.mesh_shape(), mesh_dim_names=MESH_DIMS)
    coord = layout.coord(dist.get_rank())
    # The mesh is arange(world).view(pp, dp, cp, tp): the same arithmetic as Layout.coord.
    assert tuple(mesh.get_coordinate() or ()) == (coord.pp, coord.dp, coord.cp, coord.tp), (
        mesh.get_coordinate(), coord,
    )
    return mesh


@dataclass
class ParallelDims:
    """A Layout bound to a built mesh: named sub-meshes, groups and this rank's coordinates.

    The trainer builds one and passes it down (to `parallelize` once per pipeline stage, to the
    optimizer, the checks), so the derived meshes and their process groups are created once."""

    layout: Layout
    mesh: DeviceMesh
    derived: dict[str, DeviceMesh] = field(default_factory=dict)

    @classmethod
    def build(cls, layout: Layout, device_type: str) -> ParallelDims:
        return cls.from_mesh(layout, build_mesh(layout, device_type))

    @classmethod
    def from_mesh(cls, layout: Layout, mesh: DeviceMesh) -> ParallelDims:
        """The dims of an existing 4-D mesh (collective: it may create the groups of the derived
        dimensions; every rank must call it)."""
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS or tuple(mesh.shape) != layout.mesh_shape():
            raise LayoutError(
                f"mesh {mesh} does not match the layout's (pp, dp, cp, tp) = {layout.mesh_shape()}"
            )
        dims = cls(layout=layout, mesh=mesh)
        if layout.cp > 1 or layout.ep > 1:
            # DeviceMesh has no public flatten / unflatten yet (torchtitan uses the same calls).
            dp_cp = mesh["dp", "cp"]._flatten("dp_cp")  # noqa: SLF001
            dims.derived["dp_cp"] = dp_cp
            if layout.ep > 1:
                # Runs of ep consecutive dp_cp ranks (training.model.moe.expert_parallel_groups).
                shape = (layout.dp * layout.cp // layout.ep, layout.ep)
                split = dp_cp._unflatten(0, shape, ("edp", "ep"))  # noqa: SLF001
                dims.derived["ep"], dims.derived["edp"] = split["ep"], split["edp"]
        if layout.dp_replicate > 1:  # HSDP: FSDP2 takes the 2-D (replicate, shard) mesh whole
            shape = (layout.dp_replicate, layout.dp_shard)
            hsdp = mesh["dp"]._unflatten(0, shape, ("dp_replicate", "dp_shard"))  # noqa: SLF001
            dims.derived["fsdp"] = hsdp
            dims.derived["dp_replicate"], dims.derived["dp_shard"] = hsdp["dp_replicate"], hsdp["dp_shard"]
        return dims

    def submesh(self, name: str) -> DeviceMesh:
        if name in MESH_DIMS:
            return self.mesh[name]
        if name == "dp_cp":
            return self.derived.get("dp_cp", self.mesh["dp"])  # cp == 1: the dp mesh itself
        if name in ("ep", "edp"):
            if self.layout.ep == 1:
                raise ValueError(f"mesh dimension {name!r} exists only when layout.ep > 1")
            return self.derived[name]
        if name == "fsdp":  # what ZeRO-2/3 shard over: dp x cp, or HSDP's (dp_replicate, dp_shard)
            return self.derived["fsdp"] if "fsdp" in self.derived else self.submesh("dp_cp")
        if name in ("dp_replicate", "dp_shard"):
            if self.layout.dp_replicate == 1:
                raise ValueError(f"mesh dimension {name!r} exists only when layout.dp_replicate > 1")
            return self.derived[name]
        raise ValueError(f"mesh dimension must be one of {', '.join(MESH_DIMS + DERIVED_DIMS)}, got {name!r}")

    def group(self, name: str) -> dist.ProcessGroup:
        return self.submesh(name).get_group()

    def replica_group(self) -> dist.ProcessGroup:
        """The ranks that hold exactly the same parameters as this one: dp x cp, or with expert
        parallel the expert-data-parallel group (its EP partners hold other experts), or under HSDP
        the dp_replicate group (the same local shards). ZeRO-1 shards the optimizer state over it
        and the integrity check compares fingerprints in it."""
        if self.layout.ep > 1:
            return self.group("edp")
        if self.layout.dp_replicate > 1:
            return self.group("dp_replicate")
        return self.group("dp_cp")

    @property
    def coord(self) -> RankCoord:
        return self.layout.coord(dist.get_rank())

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def cp_rank(self) -> int:
        return self.coord.cp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp
