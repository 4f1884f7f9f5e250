"""Topology without Ray: health merge, schedulability, the GET /v1/cluster shape."""

from __future__ import annotations

import pytest

from workers.topology import NodeInfo, Topology, TopologyError


def test_uniform_topology_shape_and_counts():
    t = Topology.uniform(2, 2, 4, used={"r1-n1": 3})
    assert {r: [n.name for n in ns] for r, ns in t.racks.items()} == {
        "r1": ["r1-n1", "r1-n2"], "r2": ["r2-n1", "r2-n2"]
    }
    assert (t.gpus_total, t.gpus_free, t.gpus_per_node()) == (16, 13, 4)


def test_health_and_cordon_merge_by_name_or_id_and_dead_stays_dead():
    base = Topology((
        NodeInfo("id-a", "a", "r1", gpus_total=4, gpus_free=4),
        NodeInfo("id-b", "b", "r1", gpus_total=4, gpus_free=4, alive=False, health="dead"),
    ))
    t = base.with_health({"a": "suspect", "id-b": "ready"}, cordoned=["id-a"])
    a, b = t.node("a"), t.node("b")
    assert (a.health, a.cordoned, a.schedulable) == ("suspect", True, False)
    assert b.health == "dead" and not b.schedulable
    assert t.schedulable_nodes() == ()
    assert base.with_health({"a": "suspect"}).schedulable_nodes()[0].name == "a"


def test_unknown_health_is_rejected_with_the_allowed_values():
    with pytest.raises(TopologyError, match="must be one of ready, suspect, quarantined, dead"):
        Topology.uniform(1, 1, 4, health={"r1-n1": "sick"})


def test_to_dict_for_the_cluster_endpoint_round_trips():
    t = Topology.uniform(2, 1, 4, cordoned=["r2-n1"], used={"r1-n1": 1})
    d = t.to_dict()
    assert d["gpus_total"] == 8 and d["gpus_free"] == 7 and d["gpus_schedulable"] == 3
    assert [r["name"] for r in d["racks"]] == ["r1", "r2"]
    node = next(n for n in d["nodes"] if n["name"] == "r2-n1")
    assert node["cordoned"] is True and node["schedulable"] is False and node["rack"] == "r2"
    assert Topology.from_dict(d) == t
