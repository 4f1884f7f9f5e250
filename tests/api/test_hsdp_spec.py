"""`parallelism.dp_replicate` (HSDP) through the API: kept by the planner's fill-in, refused with a
422 naming the field where no layout can have it, and nothing stored then."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import bearer
from tests.api.test_partial_layouts import demo_job
from training.config.layout import Layout


def test_a_partial_hsdp_layout_is_planned_keeping_dp_replicate(client: TestClient, tokens: dict[str, str]):
    tiny = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16}
    job = {**demo_job({"zero_stage": 3, "dp_replicate": 2}, resources={"gpus": 4}), "model": tiny}
    r = client.post("/v1/jobs", json=job, headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    layout = Layout.from_dict(r.json()["plan"]["layout"])
    assert (layout.zero_stage, layout.dp_replicate, layout.dp, layout.dp_shard) == (3, 2, 4, 2)
    assert layout.shard_peers(0) == [2]


def test_hsdp_that_does_not_fit_is_refused_naming_the_nearest(client: TestClient, tokens: dict[str, str]):
    """The demo model needs ZeRO-3 over every rank of this small test cluster: two copies of each
    shard do not fit, and the error says so and names a layout that works."""
    job = demo_job({"zero_stage": 3, "dp_replicate": 2}, resources={"gpus": 8})
    r = client.post("/v1/jobs", json=job, headers=bearer(tokens["a"]))
    assert r.status_code == 422, r.text
    message = {e["field"]: e["message"] for e in r.json()["errors"]}["parallelism"]
    assert "dp_replicate=2 needs" in message and "the nearest layout that works is" in message


@pytest.mark.parametrize("parallelism, needle", [
    ({"dp": 4, "zero_stage": 3, "dp_replicate": 3}, "dp_replicate (3) must divide dp (4)"),
    ({"dp": 4, "zero_stage": 1, "dp_replicate": 2}, "dp_replicate"),
    ({"dp_replicate": 0}, "dp_replicate"),
])
def test_an_impossible_dp_replicate_is_a_422_naming_it(client: TestClient, tokens: dict[str, str],
                                                       parallelism: dict, needle: str):
    job = demo_job(parallelism, resources={"gpus": 4})
    r = client.post("/v1/jobs", json=job, headers=bearer(tokens["a"]))
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert needle in r.text and "parallelism" in r.text
    assert client.get("/v1/jobs", headers=bearer(tokens["a"])).json()["items"] == []
