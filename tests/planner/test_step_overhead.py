"""The training loop's own work per step in a measured profile (`step_overhead_s`, training/calibration/
engine.py): it round-trips through the profile's JSON and the store, and the cost model adds it once
per step (service/planner/costmodel.finish)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service.planner import ClusterSpec, Layout, TrainSpec, evaluate, get_preset, plan
from service.planner.costmodel import Env
from service.planner.efficiency import Efficiency, HardwareProfile
from service.planner.hardware import get_gpu
from service.store.profiles import newest_profile, save_profile

DEMO = get_preset("demo")
TRAIN = TrainSpec(8, DEMO.seq_len, precision="fp32")
OVERHEAD = 4.5e-3
LAYOUTS = (  # bench/planner_accuracy.py's demo layouts
    Layout(dp=1, micro_batch_size=4, num_microbatches=2),
    Layout(dp=2, micro_batch_size=4, num_microbatches=1),
    Layout(tp=2, micro_batch_size=4, num_microbatches=2),
    Layout(pp=2, schedule="1f1b", micro_batch_size=4, num_microbatches=2),
    Layout(dp=2, zero_stage=3, micro_batch_size=4, num_microbatches=1),
)


def _profile(step_overhead_s: float = 0.0) -> HardwareProfile:
    """A CPU profile with the engine's costs measured (flat over the demo's sizes)."""
    matmul = [(s, s, s, r) for s, r in ((32, 2e9), (64, 6e9), (128, 12e9), (256, 15e9), (512, 16e9))]
    coll = {"all_reduce": [(4096.0, 1e-4 + 4096 / 1e9), (1 << 20, 1e-4 + (1 << 20) / 1e9)]}
    return HardwareProfile(
        node_type="cpu-virtual", version=1, compute_dtype="fp32", matmul={"fp32": matmul},
        attention=[(128, 16, 3e9), (512, 16, 8e9)], memory_bw=10e9, op_overhead_s=1e-5,
        optimizer_tensor_s=2e-5, optimizer_param_s=1e-9, collectives=coll, backend="gloo",
        tp_linear=[(1e4, 2e-3), (1e7, 2e-3)], fsdp_unit=[(1e4, 5e-3), (1e7, 5e-3)],
        ddp_step=[(1e4, 4e-3), (1e8, 4e-3)], concurrency=1.2, step_overhead_s=step_overhead_s,
        meta={"device": "cpu", "threads": 1, "cores": 2},
    )  # fmt: skip


def _share(ranks: int) -> float:
    """How much slower host work runs with `ranks` ranks on the profile's cores (efficiency.Efficiency):
    the calibrated overhead is timed with one rank per core."""
    return Efficiency(get_gpu("cpu-virtual"), _profile(), ranks_per_host=ranks).share


def _terms(layout: Layout, profile: HardwareProfile) -> tuple[float, dict[str, float]]:
    p = evaluate(DEMO, TRAIN, ClusterSpec("cpu-virtual", layout.world_size, profile=profile), layout)
    assert sum(p.time_breakdown_s.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    return p.step_time_s, p.time_breakdown_s


def test_step_overhead_round_trips_and_old_profiles_read_as_zero() -> None:
    p = _profile(OVERHEAD)
    doc = p.to_dict()
    assert doc["step_overhead_s"] == OVERHEAD
    again = HardwareProfile.from_dict(doc)
    assert again == p and again.to_dict() == doc
    old = {k: v for k, v in doc.items() if k != "step_overhead_s"}
    assert HardwareProfile.from_dict(old) == _profile()
    assert HardwareProfile.from_dict({**doc, "step_overhead_s": -1.0}).step_overhead_s == 0.0  # no credit


def test_step_overhead_round_trips_through_the_store(db_session_factory: sessionmaker[Session]) -> None:
    with db_session_factory() as s:
        saved = save_profile(s, _profile(OVERHEAD).to_dict())
        s.commit()
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored == saved
    assert stored.step_overhead_s == OVERHEAD and stored.to_dict()["step_overhead_s"] == OVERHEAD


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.describe())
def test_the_step_grows_by_exactly_the_overhead_once_per_step(layout: Layout) -> None:
    base, base_terms = _terms(layout, _profile())
    step, terms = _terms(layout, _profile(OVERHEAD))
    charged = OVERHEAD * _share(layout.world_size)  # 1.2: the profile's ranks computing at once
    assert base_terms["overhead"] == 0.0 and terms["overhead"] == pytest.approx(charged, rel=1e-12)
    assert step - base == pytest.approx(charged, rel=1e-9)
    assert {k: v for k, v in terms.items() if k != "overhead"} == pytest.approx(
        {k: v for k, v in base_terms.items() if k != "overhead"}, rel=1e-12)


def test_the_overhead_does_not_scale_with_micro_batches() -> None:
    one = Layout(dp=1, micro_batch_size=8, num_microbatches=1)
    four = Layout(dp=1, micro_batch_size=2, num_microbatches=4)
    for lay in (one, four):
        base, _ = _terms(lay, _profile())
        step, _ = _terms(lay, _profile(OVERHEAD))
        assert step - base == pytest.approx(OVERHEAD, rel=1e-9)


def test_a_plan_made_with_the_profile_changes_when_the_overhead_does() -> None:
    def searched(profile: HardwareProfile) -> Any:
        return plan(DEMO, TRAIN, ClusterSpec("cpu-virtual", 8, profile=profile), top_k=0)

    before, after = searched(_profile()), searched(replace(_profile(OVERHEAD), version=2))
    assert after.layout == before.layout  # a constant per step does not reorder the candidates
    # Calibrated on 2 ranks; 8 add to the loss summary's all-gather of 8 bytes a rank: log2(8) = 3
    # latency steps against 1 (formulas.hops), and 7/8 of the 64 bytes against 1/2, slowed as host work.
    tier = Env(DEMO, TRAIN, ClusterSpec("cpu-virtual", 8, profile=_profile(OVERHEAD))).node_tier
    world = _share(8) * ((3 - 1) * tier.latency + (56 - 32) / tier.bw)
    assert world > 0
    assert after.step_time_s == pytest.approx(before.step_time_s + OVERHEAD * _share(8) + world, rel=1e-9)
    assert after.time_breakdown_s["overhead"] == pytest.approx(OVERHEAD * _share(8) + world, rel=1e-12)
    assert after.to_dict()["profile"] == {"node_type": "cpu-virtual", "version": 2}


def _overhead_rank(rank: int, world: int) -> float:
    from training.calibration.engine import measure_step_overhead

    return measure_step_overhead(rank, world, steps=(1, 2))


def test_calibration_measures_the_loops_overhead_on_the_ranks() -> None:
    from tests.distributed import run_ranks

    values = run_ranks(2, _overhead_rank, timeout_s=300)
    assert values[0] == values[1]  # rank 0's figure, broadcast
    assert 0.0 < values[0] < 10.0
