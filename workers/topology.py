"""The cluster as Lattice sees it: racks -> nodes -> GPUs, with each node's health.

Built from the live Ray cluster (`Topology.from_ray`): nodes and their `rack` / `node_name`
labels from `ray.nodes()`, free GPUs from the per-node available resources, merged with the
health ledger the service keeps in its store (passed in; workers never import the service).
`Topology.uniform` builds the same structure without Ray for planning and tests.

Health values: "ready", "suspect" (a fault was seen there; still usable, used last),
"quarantined" (never used), "dead" (gone from Ray). Cordoning is an admin flag on top of
health: a cordoned node keeps its health but receives no new ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from workers.names import HEAD_RESOURCE

HEALTH_STATES: tuple[str, ...] = ("ready", "suspect", "quarantined", "dead")
RACK_LABEL = "rack"
NODE_NAME_LABEL = "node_name"
UNKNOWN_RACK = "default"


class TopologyError(ValueError):
    """A topology that cannot be built (unknown health value, duplicate node)."""


@dataclass(frozen=True)
class LinkTiers:
    """Bandwidth per GPU of each tier, GB/s. The planner may carry its own cluster spec;
    these are the defaults the topology reports."""

    intra_node_gbps: float = 900.0  # NVLink 4 through NVSwitch on an H100 node
    # InfiniBand is "roughly an order of magnitude slower ... about 8x" (lecture, 03:22).
    inter_node_gbps: float = 112.5
    # Past the rack "a second cliff" (lecture, 03:22): leaf/spine oversubscription, here 2:1.
    inter_rack_gbps: float = 56.25


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    name: str
    rack: str
    hostname: str = ""
    ip: str = ""
    gpus_total: int = 0
    gpus_free: int = 0
    alive: bool = True
    health: str = "ready"
    cordoned: bool = False
    is_head: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def schedulable(self) -> bool:
        """May receive new ranks: alive, not quarantined/dead, not cordoned, has GPUs."""
        return (
            self.alive
            and self.health in ("ready", "suspect")
            and not self.cordoned
            and self.gpus_total > 0
        )

    def unusable_reason(self) -> str | None:
        if not self.alive or self.health == "dead":
            return "dead"
        if self.health == "quarantined":
            return "quarantined"
        if self.cordoned:
            return "cordoned"
        if self.gpus_total == 0:
            return "no GPUs"
        return None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["labels"] = dict(self.labels)
        d["schedulable"] = self.schedulable
        return d


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NodeInfo, ...]
    links: LinkTiers = field(default_factory=LinkTiers)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for n in self.nodes:
            if n.node_id in seen:
                raise TopologyError(f"duplicate node id {n.node_id!r}")
            seen.add(n.node_id)
            if n.health not in HEALTH_STATES:
                raise TopologyError(
                    f"node {n.name!r} health must be one of {', '.join(HEALTH_STATES)}, got {n.health!r}"
                )

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        racks: int = 2,
        nodes_per_rack: int = 2,
        gpus_per_node: int = 4,
        *,
        health: Mapping[str, str] | None = None,
        cordoned: Collection[str] = (),
        used: Mapping[str, int] | None = None,
    ) -> Topology:
        """A synthetic topology with nodes named `r<i>-n<j>` (node id == name), as the
        embedded cluster names them. `used` maps node name -> GPUs already taken."""
        nodes = []
        for r in range(1, racks + 1):
            for j in range(1, nodes_per_rack + 1):
                name = f"r{r}-n{j}"
                taken = (used or {}).get(name, 0)
                nodes.append(
                    NodeInfo(
                        node_id=name, name=name, rack=f"r{r}", hostname=name,
                        gpus_total=gpus_per_node, gpus_free=max(gpus_per_node - taken, 0),
                    )
                )
        return cls(tuple(nodes)).with_health(health or {}, cordoned)

    @classmethod
    def from_ray(
        cls,
        health: Mapping[str, str] | None = None,
        cordoned: Collection[str] = (),
        *,
        include_dead: bool = True,
        links: LinkTiers | None = None,
    ) -> Topology:
        """Read the live cluster (the caller has `ray.init`-ed). `health` and `cordoned` are
        keyed by node name or node id; names are stable across a node's restarts, ids are not."""
        import ray
        from ray._private import state as ray_state

        available = ray_state.available_resources_per_node()
        nodes: list[NodeInfo] = []
        for raw in ray.nodes():
            alive = bool(raw.get("Alive"))
            if not alive and not include_dead:
                continue
            node_id = str(raw["NodeID"])
            labels = {str(k): str(v) for k, v in (raw.get("Labels") or {}).items()}
            resources = raw.get("Resources") or {}
            total = int(resources.get("GPU", 0))
            free = int(available.get(node_id, {}).get("GPU", 0)) if alive else 0
            hostname = str(raw.get("NodeManagerHostname") or "")
            host = hostname or str(raw.get("NodeManagerAddress") or "node")
            name = labels.get(NODE_NAME_LABEL) or f"{host}-{node_id[:8]}"
            nodes.append(
                NodeInfo(
                    node_id=node_id,
                    name=name,
                    rack=labels.get(RACK_LABEL, UNKNOWN_RACK),
                    hostname=hostname,
                    ip=str(raw.get("NodeManagerAddress") or ""),
                    gpus_total=total,
                    gpus_free=min(free, total),
                    alive=alive,
                    health="ready" if alive else "dead",
                    is_head=HEAD_RESOURCE in resources,
                    labels=labels,
                )
            )
        # A node that restarted shows up twice under one name (old id dead, new id alive):
        # keep the live one so names stay unique keys.
        by_name: dict[str, NodeInfo] = {}
        for n in nodes:
            if n.name not in by_name or (n.alive and not by_name[n.name].alive):
                by_name[n.name] = n
        ordered = sorted(by_name.values(), key=lambda n: (n.is_head, n.rack, n.name))
        return cls(tuple(ordered), links or LinkTiers()).with_health(health or {}, cordoned)

    def with_health(self, health: Mapping[str, str], cordoned: Collection[str] = ()) -> Topology:
        """Merge the store's health ledger (name or id -> health) and the cordoned set.
        A node Ray reports dead stays dead whatever the ledger says; cordons add up."""
        for key, value in health.items():
            if value not in HEALTH_STATES:
                raise TopologyError(
                    f"health of node {key!r} must be one of {', '.join(HEALTH_STATES)}, got {value!r}"
                )
        cordon = set(cordoned)
        nodes = []
        for n in self.nodes:
            h = health.get(n.node_id, health.get(n.name, n.health))
            if not n.alive:
                h = "dead"
            nodes.append(replace(n, health=h, cordoned=n.cordoned or n.node_id in cordon or n.name in cordon))
        return replace(self, nodes=tuple(nodes))

    # ---- queries ------------------------------------------------------------------------------
    def node(self, key: str) -> NodeInfo:
        for n in self.nodes:
            if key in (n.node_id, n.name):
                return n
        raise KeyError(f"no node {key!r} in the topology")

    @property
    def gpu_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.gpus_total > 0)

    @property
    def racks(self) -> dict[str, tuple[NodeInfo, ...]]:
        out: dict[str, list[NodeInfo]] = {}
        for n in self.gpu_nodes:
            out.setdefault(n.rack, []).append(n)
        return {r: tuple(ns) for r, ns in sorted(out.items())}

    @property
    def gpus_total(self) -> int:
        return sum(n.gpus_total for n in self.nodes if n.alive)

    @property
    def gpus_free(self) -> int:
        return sum(n.gpus_free for n in self.nodes if n.alive)

    @property
    def gpus_schedulable(self) -> int:
        return sum(n.gpus_free for n in self.nodes if n.schedulable)

    def schedulable_nodes(self, exclude: Iterable[str] = ()) -> tuple[NodeInfo, ...]:
        ex = set(exclude)
        return tuple(n for n in self.nodes if n.schedulable and n.node_id not in ex and n.name not in ex)

    def gpus_per_node(self) -> int:
        """The largest node's GPU count (the TP ceiling)."""
        return max((n.gpus_total for n in self.nodes), default=0)

    def to_dict(self) -> dict[str, Any]:
        """For GET /v1/cluster."""
        return {
            "racks": [
                {
                    "name": rack,
                    "gpus_total": sum(n.gpus_total for n in ns if n.alive),
                    "gpus_free": sum(n.gpus_free for n in ns if n.alive),
                    "nodes": [n.name for n in ns],
                }
                for rack, ns in self.racks.items()
            ],
            "nodes": [n.to_dict() for n in self.nodes],
            "gpus_total": self.gpus_total,
            "gpus_free": self.gpus_free,
            "gpus_schedulable": self.gpus_schedulable,
            "links": asdict(self.links),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        nodes = []
        for d in data["nodes"]:
            fields = {k: v for k, v in d.items() if k in NodeInfo.__dataclass_fields__}
            nodes.append(NodeInfo(**fields))
        return cls(tuple(nodes), LinkTiers(**data.get("links", {})))
