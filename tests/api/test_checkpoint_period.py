"""A job that leaves `checkpoint.every_steps` out gets Young's optimum period from its plan (the
predicted step time, each GPU's state and the GPUs' MTBF: service.checkpoint_period); one that sets
it (0 = only at the end) keeps it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.checkpoint_period import CHECKPOINT_FLOOR_S, checkpoint_period
from service.schemas import JobSpec
from service.settings import Settings
from tests.api.conftest import bearer
from tests.api.specs import tiny
from training.config.layout import Layout

GB = 1e9


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    # GPUs that fail every hour: the tiny job's period falls inside its 10,000 steps
    return Settings(home=tmp_path / "home", database_url=db_url, gpu_mtbf_hours=1.0)


def _plan(step_s: float, gpus: int, state_gb: float) -> dict[str, Any]:
    return {"predicted": {"step_time_s": step_s}, "cluster": {"num_gpus": gpus},
            "memory_per_gpu_bytes": {"params": state_gb / 4 * GB, "optimizer": 3 * state_gb / 4 * GB,
                                     "activations": 50 * GB}}  # activations are not written


def test_the_period_is_youngs_optimum_in_steps() -> None:
    # 20 GB of state per GPU at 1 GB/s, 16,384 GPUs at 50,000 GPU-hours each, 5 s steps
    period = checkpoint_period(_plan(5.0, 16384, 20.0), steps=100_000, mtbf_hours=50_000, write_gbps=1.0)
    mtbf_s = 50_000 * 3600 / 16384
    interval = math.sqrt(2 * 20.0 * mtbf_s)  # ~663 s
    assert period is not None and period["every_steps"] == round(interval / 5.0) == 133
    assert period["write_s"] == 20.0 and period["mtbf_s"] == pytest.approx(mtbf_s, abs=0.1)
    assert "Young" in period["why"] and "16384 GPUs" in period["why"]


def test_the_period_follows_the_failure_rate_the_state_and_the_steps() -> None:
    def every(**kw: Any) -> int:
        args = {"step_s": 5.0, "gpus": 16384, "state_gb": 20.0} | kw
        period = checkpoint_period(_plan(**args), steps=100_000, mtbf_hours=50_000, write_gbps=1.0)
        assert period is not None
        return period["every_steps"]

    assert every(gpus=4096) == pytest.approx(2 * every(), abs=1)  # a quarter of the GPUs: twice the period
    assert every(state_gb=80.0) == pytest.approx(2 * every(), abs=1)  # 4x the state: twice the period
    assert every(step_s=10.0) == pytest.approx(every() / 2, abs=1)  # the same minutes, half the steps
    # a tiny model still pays a checkpoint's fixed cost
    small = checkpoint_period(_plan(1.0, 8, 0.001), steps=10**9, mtbf_hours=50_000, write_gbps=1.0)
    assert small is not None and small["write_s"] == CHECKPOINT_FLOOR_S
    # never past the job's end (its last step is always checkpointed), never below one step
    rare = checkpoint_period(_plan(1.0, 8, 1.0), steps=30, mtbf_hours=50_000, write_gbps=1.0)
    often = checkpoint_period(_plan(600.0, 10**6, 1.0), steps=30, mtbf_hours=1, write_gbps=1.0)
    assert rare is not None and often is not None and (rare["every_steps"], often["every_steps"]) == (30, 1)
    assert checkpoint_period({"cluster": {"num_gpus": 8}}, steps=30, mtbf_hours=1, write_gbps=1.0) is None


def test_a_spec_without_a_period_runs_with_the_plans(client: TestClient, tokens: dict[str, str],
                                                     settings: Settings) -> None:
    body = tiny(train={"steps": 10_000, "global_batch": 4})
    r = client.post("/v1/jobs", json=body, headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    expected = checkpoint_period(plan, 10_000, settings.gpu_mtbf_hours, settings.checkpoint_write_gbps)
    assert expected is not None and plan["checkpoint"] == expected
    assert 1 <= expected["every_steps"] < 10_000
    spec = JobSpec.model_validate(r.json()["spec"])
    assert spec.checkpoint.every_steps is None
    config = spec.to_run_config(Layout(dp=2), "/ckpt", every_steps=plan["checkpoint"]["every_steps"])
    assert config.checkpoint.every_steps == expected["every_steps"]


@pytest.mark.parametrize("every", [0, 7])
def test_a_spec_with_a_period_keeps_it(client: TestClient, tokens: dict[str, str], every: int) -> None:
    body = tiny(train={"steps": 10_000, "global_batch": 4}, checkpoint={"every_steps": every})
    r = client.post("/v1/jobs", json=body, headers=bearer(tokens["a"]))
    assert r.status_code == 201, r.text
    assert "checkpoint" not in r.json()["plan"]
    spec = JobSpec.model_validate(r.json()["spec"])
    assert spec.to_run_config(Layout(dp=2), "/ckpt", every_steps=99).checkpoint.every_steps == every
