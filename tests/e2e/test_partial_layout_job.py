"""A job whose `parallelism` gives only tp, pp and dp runs on the embedded cluster: the planner fills
in the schedule, micro-batches and the knobs, keeps the given degrees, and the job succeeds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import LiveService, make_service, wait_for_free_gpus
from training.config.layout import Layout

pytestmark = pytest.mark.ray

SPEC: dict[str, Any] = {
    "name": "e2e-partial",
    "model": {"preset": "demo"},
    "train": {"steps": 4, "global_batch": 8, "lr": 0.003, "seed": 0},
    "parallelism": {"tp": 2, "pp": 2, "dp": 2},
    "checkpoint": {"every_steps": 2, "keep": 2},
}


@pytest.fixture(scope="module")
def svc(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    wait_for_free_gpus()
    service = make_service(ray_cluster, tmp_path_factory.mktemp("partial") / "home")
    try:
        yield service
    finally:
        service.close()


def test_a_job_with_only_tp_pp_dp_succeeds(svc: LiveService) -> None:
    submitted = svc.submit(SPEC)
    job = svc.wait_state(submitted["id"], ("succeeded", "failed", "cancelled"))
    assert job["state"] == "succeeded", job["error"]
    layout = Layout.from_dict(job["plan"]["layout"])
    assert (layout.tp, layout.pp, layout.dp, layout.global_batch) == (2, 2, 2, 8)
    assert layout.schedule != "none" and job["plan"]["given"] == {"tp": 2, "pp": 2, "dp": 2}
    assert sorted(r["rank"] for r in job["placement"]) == list(range(8))
    result = job["result"]
    assert result["final_step"] == 4 and result["loss_last"] < result["loss_first"]
