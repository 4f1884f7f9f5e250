"""A real Prometheus scrapes a real `lattice serve` (HTTP on a free port, scheduler, shared Ray
cluster) while a real job trains; PromQL through Prometheus's HTTP API sees the job's step and
throughput, and the job's series go away when the job ends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.prom import find_binary, start_prometheus, values, wait_for_value
from tests.e2e.conftest import make_service, wait_for, wait_for_free_gpus

pytestmark = pytest.mark.ray

JOB: dict[str, Any] = {
    "name": "scraped",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16},
    "data": {"kind": "synthetic", "seed": 0},
    # Long enough to be scraped while it runs; the test cancels it once it has seen the numbers.
    "train": {"steps": 400, "global_batch": 4, "lr": 0.01, "seed": 0},
    "parallelism": {"dp": 2, "micro_batch_size": 2},
    "resources": {"gpus": 2},
}


def test_prometheus_sees_a_running_job(ray_cluster: Any, tmp_path: Path) -> None:
    if find_binary("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("the prometheus binary is missing (Debian package `prometheus`; `make install`)")
        pytest.skip("prometheus is not installed")
    wait_for_free_gpus()
    svc = make_service(ray_cluster, tmp_path / "home")
    prom = None
    try:
        assert svc.runtime is not None
        url = svc.runtime.serve_in_thread(port=0)
        target = url.removeprefix("http://").rstrip("/")
        prom = start_prometheus([target], tmp_path)
        job_id = svc.submit(JOB)["id"]
        selector = f'{{job_id="{job_id}"}}'
        steps = wait_for_value(prom.url, f"lattice_job_step{selector}", lambda v: v > 0, timeout_s=180)
        tps_expr = f"lattice_job_tokens_per_second{selector}"
        tps = wait_for_value(prom.url, tps_expr, lambda v: v > 0, timeout_s=60)
        assert steps[0] >= 1 and tps[0] > 0
        # MFU measured (plan FLOPs over step time and the cluster's peak) next to the planner's prediction
        measured = wait_for_value(prom.url, f"lattice_job_mfu{selector}", lambda v: 0 < v < 1, timeout_s=30)
        predicted = wait_for_value(prom.url, f"lattice_job_mfu_predicted{selector}", lambda v: 0 < v < 1)
        assert measured and predicted
        running = values(prom.url, 'lattice_jobs{state="running"}')
        assert running and running[0] >= 1
        assert svc.api("POST", f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        svc.wait_state(job_id, ("cancelled", "succeeded"), timeout_s=120)
        # The per-job series leave /metrics with the job (low label cardinality).
        wait_for(lambda: f'job_id="{job_id}"' not in svc.api("GET", "/metrics").text, 30, "series removed")
    finally:
        if prom is not None:
            prom.stop()
        svc.close()
