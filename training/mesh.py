"""The one owner of the device mesh: Layout + world size -> DeviceMesh(pp, dp, cp, tp).

Rank order is the Layout's (TP fastest-varying, then CP, DP, PP), so a TP group is a run of
consecutive ranks. Everything else asks `ParallelDims` for a sub-mesh or a process group and
never recomputes rank arithmetic. Degenerate size-1 dimensions are kept (their groups are
single-rank), so code can always ask for `dims.group("dp")`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.layout import MESH_DIMS, Layout, LayoutError, RankCoord


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
    """A Layout bound to a built mesh: named sub-meshes, groups and this rank's coordinates."""

    layout: Layout
    mesh: DeviceMesh

    @classmethod
    def build(cls, layout: Layout, device_type: str) -> ParallelDims:
        if layout.cp > 1:
            raise LayoutError("layout.cp > 1 (context parallel) is not supported by the train loop; use cp=1")
        if layout.ep > 1:
            raise LayoutError("layout.ep > 1 (expert parallel) is not supported by the train loop; use ep=1")
        return cls(layout=layout, mesh=build_mesh(layout, device_type))

    def submesh(self, name: str) -> DeviceMesh:
        if name not in MESH_DIMS:
            raise ValueError(f"mesh dimension must be one of {', '.join(MESH_DIMS)}, got {name!r}")
        return self.mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        return self.submesh(name).get_group()

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
    def pp_rank(self) -> int:
        return self.coord.pp
