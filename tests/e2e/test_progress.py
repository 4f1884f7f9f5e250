"""Progress in the job, on the embedded cluster: while a small job trains, `GET /v1/jobs/{id}` shows
its step moving, the median step time and an ETA once steps are timed, MFU equal to the
`lattice_job_mfu` metric and a reason; at the end the goodput parts add up to the wall time."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import LiveService, make_service, wait_for, wait_for_free_gpus

pytestmark = pytest.mark.ray

JOB: dict[str, Any] = {
    "name": "progress",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16},
    "data": {"kind": "synthetic", "seed": 0},
    "train": {"steps": 150, "global_batch": 4, "lr": 0.01, "seed": 0},
    "parallelism": {"dp": 2, "micro_batch_size": 2},
    "resources": {"gpus": 2},
}


def _metric(text: str, name: str, job_id: str) -> float | None:
    for line in text.splitlines():
        m = re.fullmatch(rf'{name}\{{([^}}]*)\}} (\S+)', line)
        if m and f'job_id="{job_id}"' in m.group(1):
            assert 'job_name="progress"' in m.group(1) and 'tenant="' in m.group(1), line
            return float(m.group(2))
    return None


def _consistent_mfu(svc: LiveService, job_id: str) -> tuple[float, float] | None:
    """progress.mfu and lattice_job_mfu read from the same controller snapshot: the step in the API
    before and after the scrape and in the scrape are one step (else None: read again)."""
    before = svc.job(job_id)["progress"]
    text = svc.api("GET", "/metrics").text
    after = svc.job(job_id)["progress"]
    metric, step = _metric(text, "lattice_job_mfu", job_id), _metric(text, "lattice_job_step", job_id)
    if before["step"] != after["step"] or step != after["step"] or metric is None or after["mfu"] is None:
        return None
    return after["mfu"], metric


def test_progress_moves_and_goodput_adds_up(ray_cluster: Any, tmp_path: Path) -> None:
    wait_for_free_gpus()
    svc = make_service(ray_cluster, tmp_path / "home")
    try:
        job_id = svc.submit(JOB)["id"]
        seen: list[dict[str, Any]] = []

        def running_with_steps() -> bool:
            job = svc.job(job_id)
            seen.append(job)
            assert job["reason"], job
            return job["state"] in ("succeeded", "failed") or (
                job["state"] == "running" and job["progress"]["step"] >= 3
                and job["progress"]["eta_s"] is not None)

        wait_for(running_with_steps, 180, "a running job with timed steps", interval_s=0.1)
        mfu = wait_for(lambda: _consistent_mfu(svc, job_id), 60, "progress.mfu next to lattice_job_mfu",
                       interval_s=0.05)
        assert mfu[0] == pytest.approx(mfu[1], rel=1e-9) and 0 < mfu[0] < 1
        end = svc.wait_state(job_id, ("succeeded", "failed", "cancelled"), timeout_s=240)
        assert end["state"] == "succeeded", end.get("error")

        running = [j for j in seen if j["state"] == "running" and j["progress"]["step"] > 0]
        assert running, [j["state"] for j in seen]
        steps = [j["progress"]["step"] for j in seen]
        assert steps == sorted(steps) and steps[-1] > steps[0]  # the step moved while we watched
        timed = running[-1]["progress"]
        assert timed["step_time_s"] > 0 and timed["eta_s"] >= 0 and timed["mfu"] is not None
        assert timed["total_steps"] == 150 and running[-1]["reason"] == "running"

        p = end["progress"]
        assert p["step"] == 150 and end["reason"].startswith("succeeded")
        parts = p["goodput"]
        wall = (dt.datetime.fromisoformat(end["finished_at"]) - dt.datetime.fromisoformat(end["created_at"]))
        assert sum(parts.values()) == pytest.approx(wall.total_seconds(), rel=0.05)
        assert parts["startup_s"] > 0 and parts["useful_s"] > 0  # start-up is its own part, not lost
        assert parts["restarting_s"] == 0  # no fault
        # predicted vs measured (issue 16): the ranks' medians after warm-up next to the plan's
        perf = end["performance"]
        assert perf["predicted"]["step_time_s"] == end["plan"]["predicted"]["step_time_s"]
        measured = perf["measured"]
        assert measured["steps"] > 100 and measured["step_time_s"] > 0
        assert {"compute", "dp_sync", "optimizer"} <= set(measured["phases_s"])
        assert perf["ratio"] == pytest.approx(measured["step_time_s"] / perf["predicted"]["step_time_s"])
    finally:
        svc.close()
