"""The planner's feedback from finished jobs (service.planner.feedback): a bounded step of the
compute efficiency toward the measurement, never beyond it."""

from __future__ import annotations

import math

import pytest

from service.planner.feedback import (
    ALPHA,
    MAX_STEP,
    compute_factor,
    predicted_after,
    refine_profile,
    update_curve,
)


@pytest.mark.parametrize("measured", [0.02, 0.05, 0.09, 0.11, 0.2, 1.0, 10.0])
def test_the_prediction_moves_toward_the_measurement_and_never_past_it(measured: float) -> None:
    predicted, compute = 0.1, 0.07
    f = compute_factor(measured, predicted, compute)
    after = predicted_after(predicted, compute, f)
    lo, hi = min(measured, predicted), max(measured, predicted)
    assert lo <= after <= hi
    assert abs(after - measured) < abs(predicted - measured)  # it moved
    assert 1 / MAX_STEP <= f <= MAX_STEP


def test_the_step_is_alpha_of_the_way_in_log_space_when_unclamped() -> None:
    predicted, compute, measured = 0.1, 0.1, 0.125  # all compute: the exact factor is 0.8
    f = compute_factor(measured, predicted, compute)
    assert f == pytest.approx(math.exp(ALPHA * math.log(0.8)))
    assert compute_factor(0.1, 0.1, 0.1) == 1.0  # a perfect prediction changes nothing


def test_one_update_changes_the_efficiency_by_at_most_the_bound() -> None:
    # 15x slower (the demo's first screen): one job moves the curve by at most the per-update bound
    f = compute_factor(1.5, 0.1, 0.09, alpha=1.0)
    assert f == pytest.approx(1 / MAX_STEP)
    assert compute_factor(0.001, 0.1, 0.09, alpha=1.0) == pytest.approx(MAX_STEP)
    with pytest.raises(ValueError, match="alpha"):
        compute_factor(1.0, 1.0, 1.0, alpha=0.0)


def test_update_curve_scales_every_rate_and_keeps_the_shape() -> None:
    curve = [(128, 128, 128, 1e9), (1024, 1024, 1024, 4e9)]
    slower = update_curve(curve, measured_s=0.2, predicted_s=0.1, compute_s=0.1)
    f = compute_factor(0.2, 0.1, 0.1)
    assert [p[:3] for p in slower] == [p[:3] for p in curve]
    assert [p[3] for p in slower] == pytest.approx([1e9 * f, 4e9 * f])
    assert all(new[3] < old[3] for new, old in zip(slower, curve, strict=True))


def test_refine_profile_makes_a_new_version_that_records_the_job() -> None:
    doc = {"node_type": "cpu", "version": 3, "compute_dtype": "fp32",
           "matmul": {"fp32": [[64, 64, 64, 2e9]], "bf16": [[64, 64, 64, 1e9]]},
           "attention": [[128, 64, 1e9]], "meta": {"device": "x"}}
    new = refine_profile(doc, 0.5, job_id="j1", ratio=2.0)
    assert new["version"] == 4 and doc["version"] == 3  # the input is not changed
    assert new["matmul"]["fp32"][0][3] == 1e9 and new["matmul"]["bf16"][0][3] == 1e9  # only the compute dtype
    assert new["attention"][0][2] == 5e8
    assert new["meta"]["feedback"][-1] == {"job_id": "j1", "from_version": 3, "factor": 0.5,
                                            "measured_over_predicted": 2.0}
    assert new["meta"]["device"] == "x"
