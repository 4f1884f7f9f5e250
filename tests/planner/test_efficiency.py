"""Efficiency as a function of shape (service/planner/efficiency.py) and plans made with a profile."""

from __future__ import annotations

import random

import pytest

from service.planner import ClusterSpec, PlannerError, TrainSpec, get_preset, plan
from service.planner.efficiency import Efficiency, HardwareProfile, MonotoneCurve, fit_alpha_beta
from service.planner.hardware import get_gpu


def _profile(version: int = 1, scale: float = 1.0, node_type: str = "cpu-virtual") -> HardwareProfile:
    """A CPU-like profile: matmul rate growing with size, gloo-like collectives."""
    matmul = [(s, s, s, scale * r) for s, r in ((32, 2e9), (64, 6e9), (128, 12e9), (256, 15e9), (512, 16e9))]
    coll = {"all_reduce": [(4096.0, 1e-4 + 4096 / 1e9), (1 << 20, 1e-4 + (1 << 20) / 1e9)]}
    attention = [(128, 64, scale * 3e9), (512, 64, scale * 8e9)]
    return HardwareProfile(node_type=node_type, version=version, compute_dtype="fp32",
                           matmul={"fp32": matmul}, attention=attention, memory_bw=10e9,
                           collectives=coll, backend="gloo")  # fmt: skip


def test_monotone_curve_is_nondecreasing_over_noisy_measurements() -> None:
    rng = random.Random(0)
    points = [(2.0**i, (1 - 0.9**i) + rng.uniform(-0.2, 0.2)) for i in range(1, 30)]
    curve = MonotoneCurve(points)
    xs = [2.0 ** (i / 4) for i in range(0, 130)]
    ys = [curve(x) for x in xs]
    assert all(b >= a - 1e-12 for a, b in zip(ys, ys[1:], strict=False))
    # Isotonic regression keeps the mean of the measurements (pooling averages, never inflates).
    assert sum(curve.ys) == pytest.approx(sum(max(y, 1e-300) for _, y in points if y > 0), rel=1e-9)


def test_measured_matmul_efficiency_is_monotone_in_size_even_when_a_point_dips() -> None:
    p = _profile()
    dip = dict(p.matmul)
    dip["fp32"] = [*p.matmul["fp32"], (384, 384, 384, 1e9)]  # a noisy slow measurement between 256 and 512
    eff = Efficiency(get_gpu("cpu-virtual"), HardwareProfile(**{**p.__dict__, "matmul": dip}))
    rates = [eff.matmul_rate(s, s, s) for s in (16, 32, 48, 64, 100, 128, 200, 256, 384, 512, 4096)]
    assert all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    assert rates[-1] <= 16e9  # never above the best measured rate


def test_catalogued_curve_rises_with_size_and_stays_below_its_max() -> None:
    eff = Efficiency(get_gpu("A100-80GB"))
    small, mid, big = (eff.matmul_rate(s, s, s) for s in (256, 2048, 16384))
    assert small < mid < big < eff.peak * eff.curve.mm_max


def test_alpha_beta_fit_recovers_latency_and_bandwidth() -> None:
    alpha, beta = fit_alpha_beta([(b, 20e-6 + b / 5e9) for b in (1e3, 1e5, 1e7)])
    assert alpha == pytest.approx(20e-6, rel=1e-6) and beta == pytest.approx(5e9, rel=1e-6)


def test_profile_round_trips_through_its_json() -> None:
    p = _profile(version=3)
    assert HardwareProfile.from_dict(p.to_dict()) == HardwareProfile.from_dict(p.to_dict())
    assert HardwareProfile.from_dict(p.to_dict()).to_dict() == p.to_dict()
    with pytest.raises(ValueError, match="profile"):
        HardwareProfile.from_dict({"node_type": "x", "matmul": {"bf16": [[1, 2]]}})


def test_a_plan_with_a_profile_changes_with_the_profile_and_records_its_version() -> None:
    model, train = get_preset("demo"), TrainSpec(global_batch=16, seq_len=get_preset("demo").seq_len)
    base = plan(model, train, ClusterSpec("cpu-virtual", 8), top_k=0)
    v1 = plan(model, train, ClusterSpec("cpu-virtual", 8, profile=_profile(1)), top_k=0)
    v2 = plan(model, train, ClusterSpec("cpu-virtual", 8, profile=_profile(2, scale=2.0)), top_k=0)
    assert base.profile is None and base.to_dict()["profile"] is None
    assert v1.to_dict()["profile"] == {"node_type": "cpu-virtual", "version": 1}
    assert v2.to_dict()["profile"] == {"node_type": "cpu-virtual", "version": 2}
    assert v1.step_time_s != base.step_time_s
    assert v2.time_breakdown_s["compute"] < v1.time_breakdown_s["compute"]  # twice the measured rate


def test_measured_links_replace_the_catalogue_intra_node_tier() -> None:
    from service.planner.costmodel import Env

    model = get_preset("demo")
    train = TrainSpec(global_batch=16, seq_len=model.seq_len)
    env = Env(model, train, ClusterSpec("cpu-virtual", 8, profile=_profile()))
    # 2 ranks: a ring all-reduce sends the whole message once; 1e9 B/s and 100 us measured.
    assert env.node_tier.bw == pytest.approx(1e9, rel=1e-6)
    assert env.node_tier.latency == pytest.approx(50e-6, rel=1e-6)


def test_unknown_attention_kernel_is_refused() -> None:
    with pytest.raises(PlannerError, match="train.attention"):
        TrainSpec(global_batch=8, seq_len=128, attention="paged")


def test_unfused_attention_is_slower_than_flash() -> None:
    model = get_preset("gpt3-175b")
    cluster = ClusterSpec("A100-80GB", 1024)
    flash = plan(model, TrainSpec(1536, 2048), cluster, top_k=0)
    from service.planner import evaluate

    unfused = evaluate(model, TrainSpec(1536, 2048, attention="unfused"), cluster, flash.layout)
    assert unfused.step_time_s > flash.step_time_s


def test_cpu_ranks_share_the_calibrated_cores_and_pay_a_fixed_cost_per_op() -> None:
    base = _profile()
    cpu = HardwareProfile(
        **{**base.__dict__, "op_overhead_s": 1e-5, "meta": {"device": "cpu", "threads": 1, "cores": 2}}
    )
    gpu = get_gpu("cpu-virtual")
    alone, crowded = Efficiency(gpu, cpu, ranks_per_host=2), Efficiency(gpu, cpu, ranks_per_host=8)
    assert crowded.matmul_time(128, 128, 128) == pytest.approx(4 * alone.matmul_time(128, 128, 128))
    assert alone.ops_time(busy_s=1.0, ops=100) == pytest.approx(1e-3)  # CPU ops run one after another
    # On a GPU launches are asynchronous: only dispatch time beyond the kernels' shows.
    gpu_profile = HardwareProfile(**{**cpu.__dict__, "meta": {"device": "NVIDIA H100 80GB HBM3"}})
    on_gpu = Efficiency(get_gpu("H100"), gpu_profile)
    assert on_gpu.ops_time(busy_s=1.0, ops=100) == 0.0 and on_gpu.ops_time(
        busy_s=0.0, ops=100
    ) == pytest.approx(1e-3)
    assert HardwareProfile.from_dict(cpu.to_dict()).op_overhead_s == 1e-5
