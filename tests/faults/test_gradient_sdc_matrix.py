"""Gradient bit-flip cells of the fault matrix (issue 17): a flip of one element of a rank's local
gradient before the DP reduction, by bit class (exponent, mantissa, sign) x {early, mid-run}, with
the opt-in linear-layer checksums on (integrity.abft), and a flip in a rank's reduced bucket
(communication). Each is detected in its step, the rank is named, the job restarts from a verified
checkpoint and ends bit-identical to a fault-free run. Fast checks of the same:
tests/training/test_gradient_sdc.py.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.faults.harness import (
    assert_in_order,
    assert_succeeded_like_fault_free,
    job_cfg,
    options,
    run_job,
    sdc_attribution,
    wait_for_free_gpus,
)
from training.config.run import IntegrityConfig

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SEED = 17
BITS = {"exponent": 30, "mantissa": 22, "sign": 31}
TIMINGS = {"early": 1, "mid": 3}
CASES = [(c, t) for c in BITS for t in TIMINGS]
LINEAR = "layers.0.feed_forward.w1.weight"  # an ABFT-checked linear weight


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


def _cfg(tmp_path):
    return replace(job_cfg(str(tmp_path / "ckpt")), integrity=IntegrityConfig(abft=True))


@pytest.mark.parametrize(("cls", "timing"), CASES, ids=[f"{c}-{t}" for c, t in CASES])
def test_gradient_flip_is_detected_and_the_rank_named(cls, timing, tmp_path):
    rng = random.Random(f"{SEED}-{cls}-{timing}")
    victim = rng.randrange(2)
    flip = {"kind": "bitflip", "rank": victim, "at_step": TIMINGS[timing], "target": "grad", "name": LINEAR,
            "bit": BITS[cls], "index": rng.randrange(1024)}
    cfg = _cfg(tmp_path)
    snap = run_job(f"fm-grad-{cls}-{timing}", cfg, options(flip, quarantine_after=1, quarantine_jobs=1))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "failure", "attributed", "restart", "restore", "finished"])
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [victim]
    kind = attributed["evidence"].get("error_kind")
    assert kind in ("grad_norm_outlier", "grad_abft", "grad_norm_spike", "nonfinite"), kind


def test_reduced_bucket_flip_is_caught_by_the_checksum(tmp_path):
    flip = {"kind": "bitflip", "rank": 1, "at_step": 3, "target": "reduce", "name": LINEAR, "bit": 30,
            "index": 5}
    cfg = _cfg(tmp_path)
    snap = run_job("fm-grad-reduce", cfg, options(flip, quarantine_after=1, quarantine_jobs=1))
    assert_succeeded_like_fault_free(snap, cfg)
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [1]
    assert attributed["evidence"].get("error_kind") == "grad_checksum"
