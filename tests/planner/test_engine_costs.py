"""The engine's own parallel costs in a measured profile (training/calibration/engine.py): per TP linear,
per ZeRO-3 unit, ranks computing at once; and how the cost model charges them (service/planner)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from service.planner import ClusterSpec, Layout, TrainSpec, evaluate, get_preset
from service.planner.efficiency import Efficiency, HardwareProfile
from service.planner.hardware import get_gpu

DEMO = get_preset("demo")  # 4 layers, hidden 128, SwiGLU: 7 sharded linears per block
TRAIN = TrainSpec(8, DEMO.seq_len, precision="fp32")


def _profile(tp_linear: float = 0.0, fsdp_unit: float = 0.0, concurrency: float = 1.0,
             ddp_step: float = 0.0) -> HardwareProfile:
    """A CPU profile; engine costs flat over sizes that bracket the demo's messages and units."""
    matmul = [(s, s, s, r) for s, r in ((32, 2e9), (64, 6e9), (128, 12e9), (256, 15e9), (512, 16e9))]
    coll = {"all_reduce": [(4096.0, 1e-4 + 4096 / 1e9), (1 << 20, 1e-4 + (1 << 20) / 1e9)]}
    return HardwareProfile(
        node_type="cpu-virtual", version=1, compute_dtype="fp32", matmul={"fp32": matmul},
        attention=[(128, 16, 3e9), (512, 16, 8e9)], memory_bw=10e9, collectives=coll, backend="gloo",
        tp_linear=[(1e4, tp_linear), (1e7, tp_linear)] if tp_linear else [],
        fsdp_unit=[(1e4, fsdp_unit), (1e7, fsdp_unit)] if fsdp_unit else [],
        ddp_step=[(1e4, ddp_step), (1e8, ddp_step)] if ddp_step else [],
        concurrency=concurrency, meta={"device": "cpu", "threads": 1, "cores": 2},
    )  # fmt: skip


def _eval(layout: Layout, profile: HardwareProfile | None) -> dict[str, float]:
    cluster = ClusterSpec("cpu-virtual", layout.world_size, profile=profile)
    p = evaluate(DEMO, TRAIN, cluster, layout)
    assert sum(p.time_breakdown_s.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    return p.time_breakdown_s


def test_engine_costs_round_trip_and_old_profiles_read_without_them() -> None:
    p = _profile(tp_linear=2e-3, fsdp_unit=5e-3, concurrency=1.3, ddp_step=9e-3)
    again = HardwareProfile.from_dict(p.to_dict())
    assert again == p and again.to_dict() == p.to_dict()
    new_fields = ("tp_linear", "fsdp_unit", "ddp_step", "concurrency")
    old = {k: v for k, v in p.to_dict().items() if k not in new_fields}
    assert HardwareProfile.from_dict(old) == _profile()  # none measured: no engine terms, concurrency 1


def test_tp_time_counts_the_engines_sharded_linears_at_the_measured_cost() -> None:
    lay = Layout(tp=2, micro_batch_size=4, num_microbatches=2)
    per_linear = 2e-3
    terms = _eval(lay, _profile(tp_linear=per_linear))
    # Each micro-batch: 7 sharded linears per block x 4 blocks, plus the embedding and the head.
    assert terms["tp"] == pytest.approx(2 * (7 * 4 + 2) * per_linear)
    # Without the measurement the alpha-beta model of the bare all-reduce stays (much cheaper here).
    assert _eval(lay, _profile())["tp"] < terms["tp"] / 5


def test_zero3_time_charges_each_fsdp_unit_every_micro_batch() -> None:
    per_unit = 4e-3
    lay = Layout(dp=2, zero_stage=3, micro_batch_size=2, num_microbatches=2)
    terms = _eval(lay, _profile(fsdp_unit=per_unit))
    # 4 blocks + the root, every micro-batch; on CPU nothing overlaps (gloo computes on the same cores).
    assert terms["dp_exposed"] == pytest.approx(2 * 5 * per_unit)
    zero0 = Layout(dp=2, micro_batch_size=2, num_microbatches=2)
    assert _eval(zero0, _profile(fsdp_unit=per_unit))["dp_exposed"] == _eval(zero0, _profile())["dp_exposed"]


def test_ddp_time_is_the_measured_step_cost_once_per_step() -> None:
    lay = Layout(dp=2, micro_batch_size=2, num_microbatches=2)
    assert _eval(lay, _profile(ddp_step=7e-3))["dp_exposed"] == pytest.approx(7e-3)  # not per micro-batch
    zero3 = Layout(dp=2, zero_stage=3, micro_batch_size=2, num_microbatches=2)
    assert _eval(zero3, _profile(ddp_step=7e-3))["dp_exposed"] == _eval(zero3, _profile())["dp_exposed"]


def test_ranks_computing_at_once_slow_compute_by_the_measured_factor() -> None:
    gpu = get_gpu("cpu-virtual")
    slow, quiet = _profile(concurrency=1.5), _profile()
    two = Efficiency(gpu, slow, ranks_per_host=2).matmul_time(128, 128, 128)
    assert two == pytest.approx(1.5 * Efficiency(gpu, quiet, ranks_per_host=2).matmul_time(128, 128, 128))
    # One rank alone computes at the solo rate; more ranks than cores keep the cores' share.
    assert Efficiency(gpu, slow, ranks_per_host=1).matmul_time(128, 128, 128) == pytest.approx(two / 1.5)
    assert Efficiency(gpu, slow, ranks_per_host=8).share == pytest.approx(4.0)


def test_more_ranks_than_cores_pay_the_measured_oversubscription_per_workload() -> None:
    """At 4 processes a core the ops (dispatch-bound work, the loop's Python) and the matmuls are slowed
    by their own measured factors on top of the ideal share; at one a core by neither."""
    gpu = get_gpu("cpu-virtual")
    over = {"ops": [(2.0, 1.3), (4.0, 1.4)], "matmul": [(2.0, 1.1), (4.0, 1.2)]}
    base = replace(_profile(tp_linear=2e-3), op_overhead_s=1e-5, step_overhead_s=3e-3,
                   optimizer_tensor_s=3e-5)
    crowded = replace(base, oversubscription=over)
    assert HardwareProfile.from_dict(crowded.to_dict()) == crowded
    assert HardwareProfile.from_dict({k: v for k, v in crowded.to_dict().items()
                                      if k != "oversubscription"}) == base  # fmt: skip
    ideal, real = Efficiency(gpu, base, ranks_per_host=8), Efficiency(gpu, crowded, ranks_per_host=8)
    assert real.share == ideal.share == pytest.approx(4.0)
    assert real.matmul_time(128, 128, 128) == pytest.approx(1.2 * ideal.matmul_time(128, 128, 128))
    assert real.ops_time(0.0, 150) == pytest.approx(1.4 * ideal.ops_time(0.0, 150))
    assert real.step_overhead == pytest.approx(1.4 * ideal.step_overhead)  # the loop's Python
    assert real.optimizer_tensor == pytest.approx(ideal.optimizer_tensor)  # fused passes: the share alone
    assert real.tp_linear_time(1e5, 1e9) == pytest.approx(ideal.tp_linear_time(1e5, 1e9))  # waits: share
    # Between the measured levels: linear (3 a core: halfway from 1.3 to 1.4); beyond the last: flat.
    assert Efficiency(gpu, crowded, ranks_per_host=6).share_ops == pytest.approx(3 * 1.35)
    assert Efficiency(gpu, crowded, ranks_per_host=16).share_ops == pytest.approx(8 * 1.4)
    assert Efficiency(gpu, crowded, ranks_per_host=2).share_ops == pytest.approx(1.0)
    # An 8-rank job's compute moves by between the two factors, its DP time not at all; a GPU profile's
    # (no sharing) does not move.
    lay = Layout(dp=8, micro_batch_size=1, num_microbatches=1)
    slow, fast = _eval(lay, crowded), _eval(lay, base)
    assert 1.2 * fast["compute"] < slow["compute"] < 1.4 * fast["compute"]
    assert slow["dp_exposed"] == fast["dp_exposed"]
    on_gpu = {"meta": {"device": "cuda", "threads": 1, "cores": 2}}
    assert Efficiency(gpu, replace(crowded, **on_gpu), ranks_per_host=8).share_ops == 1.0


def test_host_work_measured_one_rank_per_core_slows_with_more_ranks_than_cores() -> None:
    """The engine's measured costs, the optimizer step and the loop's overhead are host work on CPU
    ranks, timed with one rank per core: 8 ranks on the profile's 2 cores do it 4x slower, as they
    compute. A GPU profile's are not shared (each rank has its device)."""
    gpu = get_gpu("cpu-virtual")
    base = _profile(tp_linear=2e-3, fsdp_unit=5e-3, ddp_step=9e-3)
    prof = HardwareProfile(**{**base.__dict__, "optimizer_tensor_s": 3e-5, "optimizer_param_s": 4e-9,
                              "step_overhead_s": 3e-3})
    alone, crowded = Efficiency(gpu, prof, ranks_per_host=2), Efficiency(gpu, prof, ranks_per_host=8)
    assert (alone.share, crowded.share) == (1.0, 4.0)
    for cost in ("tp_linear_time", "fsdp_unit_time", "ddp_step_time"):
        assert getattr(crowded, cost)(1e5, 1e9) == pytest.approx(4 * getattr(alone, cost)(1e5, 1e9))
    for term in ("optimizer_tensor", "optimizer_param", "step_overhead"):
        assert getattr(crowded, term) == pytest.approx(4 * getattr(alone, term))
    on_gpu = HardwareProfile(**{**prof.__dict__, "meta": {"device": "cuda", "threads": 1, "cores": 2}})
    assert Efficiency(gpu, on_gpu, ranks_per_host=8).tp_linear_time(1e5, 1e9) == pytest.approx(2e-3)
    assert Efficiency(gpu, on_gpu, ranks_per_host=8).step_overhead == pytest.approx(3e-3)


def test_measured_engine_cost_is_monotone_in_size_and_grows_with_the_link_beyond_it() -> None:
    gpu = get_gpu("cpu-virtual")
    p = HardwareProfile(**{**_profile().__dict__, "tp_linear": [(1e5, 2e-3), (1e6, 1.5e-3), (4e6, 4e-3)]})
    eff = Efficiency(gpu, p)
    sizes = [1e3, 1e5, 3e5, 1e6, 2e6, 4e6]
    costs = [eff.tp_linear_time(b, link_bw=1e9) for b in sizes]
    assert all(c is not None for c in costs)
    assert costs == sorted(costs)  # a bigger message never costs less (noise between points averaged)
    assert eff.tp_linear_time(5e6, link_bw=1e9) == pytest.approx(costs[-1] + 1e6 / 1e9)
    assert Efficiency(gpu, _profile()).tp_linear_time(1e5, 1e9) is None
    assert Efficiency(gpu, None).fsdp_unit_time(1e5, 1e9) is None



def test_the_measured_optimizer_step_charges_each_tensor_and_parameter_a_rank_steps() -> None:
    """Clip + AdamW as measured: a fixed cost per parameter tensor (AdamW loops over them where nothing
    fuses) and a cost per parameter; our ZeRO-1 steps only the tensors and parameters a rank owns."""
    from training.config.arithmetic import total_params

    per_tensor, per_param = 40e-6, 4e-9
    measured = replace(_profile(), optimizer_tensor_s=per_tensor, optimizer_param_s=per_param)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    tensors = DEMO.layers * (4 + 3 + 2) + 3 - DEMO.tied_embeddings  # per block; embedding, head, final norm
    whole = tensors * per_tensor + total_params(DEMO) * per_param
    lay = Layout(dp=1, micro_batch_size=4, num_microbatches=2)
    assert _eval(lay, measured)["optimizer"] == pytest.approx(whole, rel=1e-6)
    zero1 = _eval(Layout(dp=2, zero_stage=1, micro_batch_size=4, num_microbatches=1), measured)["optimizer"]
    assert zero1 == pytest.approx(whole / 2, rel=1e-6)
    # Unmeasured: the fp32 state's bytes at the memory bandwidth, as before (much less on this profile).
    assert _eval(lay, _profile())["optimizer"] < _eval(lay, measured)["optimizer"] / 2


def test_fsdp2_optimizer_step_charges_what_dtensor_adds_per_tensor() -> None:
    """ZeRO-2/3 step every DTensor shard: each tensor costs the plain per-tensor figure plus what the
    calibration measured DTensor dispatch to add; DP and ZeRO-1 step plain tensors and are unchanged."""
    per_tensor, per_param, dtensor = 40e-6, 4e-9, 300e-6
    plain = replace(_profile(), optimizer_tensor_s=per_tensor, optimizer_param_s=per_param)
    measured = replace(plain, fsdp_optimizer_tensor_s=dtensor)
    assert HardwareProfile.from_dict(measured.to_dict()) == measured
    tensors = DEMO.layers * (4 + 3 + 2) + 3 - DEMO.tied_embeddings
    cores_share = 2 / 2  # 2 single-thread ranks on the profile's 2 cores
    for zero in (2, 3):
        lay = Layout(dp=2, zero_stage=zero, micro_batch_size=4, num_microbatches=1)
        extra = _eval(lay, measured)["optimizer"] - _eval(lay, plain)["optimizer"]
        assert extra == pytest.approx(tensors * dtensor * cores_share, rel=1e-6)
    for lay in (Layout(dp=2, micro_batch_size=4, num_microbatches=1),
                Layout(dp=2, zero_stage=1, micro_batch_size=4, num_microbatches=1)):
        assert _eval(lay, measured)["optimizer"] == _eval(lay, plain)["optimizer"]


def test_ranks_sharing_cores_fill_each_others_pipeline_bubble() -> None:
    """With dedicated devices a 1F1B pipeline idles (pp - 1) / m of its work; CPU ranks sharing cores
    run one another's work meanwhile: the step is the larger of all work at the shared rate and the
    schedule's critical path at the solo rate."""
    def bubble_and_work(layout: Layout, profile: HardwareProfile | None) -> tuple[float, float]:
        t = _eval(layout, profile)
        core = sum(t.values()) - t["dp_exposed"] - t["optimizer"] - t["overhead"]
        return t["bubble"], core - t["bubble"]

    pp2 = Layout(pp=2, schedule="1f1b", micro_batch_size=4, num_microbatches=2)  # bubble fraction 1/2
    for alone in (None, _profile()):  # the catalogue; a profile with one rank per core
        bubble, work = bubble_and_work(pp2, alone)
        assert bubble == pytest.approx(0.5 * work)
    bubble, work = bubble_and_work(pp2, _profile(concurrency=1.2))  # shared 1.2x: 1.5 / 1.2 = 1.25
    assert bubble == pytest.approx(0.25 * work)
    crowded = Layout(pp=2, dp=4, schedule="1f1b", micro_batch_size=1, num_microbatches=2)  # 8 ranks
    bubble, work = bubble_and_work(crowded, _profile())
    assert bubble == 0.0 and work > 0


def _dp4(profile: HardwareProfile, gpus_per_node: int) -> float:
    """Exposed DP seconds of DP 4 on nodes of `gpus_per_node` (2: the DP group crosses nodes)."""
    lay = Layout(dp=4, micro_batch_size=2, num_microbatches=1)
    cluster = ClusterSpec("cpu-virtual", 4, gpus_per_node=gpus_per_node, profile=profile)
    return evaluate(DEMO, TRAIN, cluster, lay).time_breakdown_s["dp_exposed"]


def test_a_measured_inter_node_tier_prices_dp_across_nodes() -> None:
    measured = _profile(ddp_step=7e-3)
    same = dataclasses.replace(measured, inter_node=measured.collectives)
    assert HardwareProfile.from_dict(same.to_dict()) == same  # round-trips; older docs read as {}
    older = {k: v for k, v in same.to_dict().items() if k != "inter_node"}
    assert HardwareProfile.from_dict(older).inter_node == {}
    # Nodes linked as fast as ranks inside one (the embedded cluster's virtual nodes share a host): the
    # engine's measured DDP cost holds across them, not the catalogue's 20 MB/s planning link.
    in_node = _dp4(same, 4)
    assert in_node > 0 and _dp4(same, 2) == pytest.approx(in_node)
    assert _dp4(measured, 2) > 10 * in_node
    # A 10x slower link between nodes: the measured cost plus what the slower tier adds to the all-reduce.
    slow = {"all_reduce": [(b, 10 * t) for b, t in measured.collectives["all_reduce"]]}
    assert in_node < _dp4(dataclasses.replace(same, inter_node=slow), 2) < _dp4(measured, 2)


def test_a_dp_group_wider_than_the_calibration_pays_the_extra_latency_steps_and_bytes() -> None:
    """The engine's DDP and FSDP2 costs are timed on 2 ranks; a group of 8 (one node) adds what the ring
    collectives of 8 take beyond those of 2: log2(8) = 3 latency steps per collective against 1, 7/4 of
    the all-reduced bytes against 1 (tiers.wider), slowed as host work."""
    from service.planner.costmodel import Env
    from training.config.arithmetic import total_params

    def dp(n: int, zero: int, profile: HardwareProfile) -> float:
        lay = Layout(dp=n, zero_stage=zero, micro_batch_size=8 // n, num_microbatches=1)
        cluster = ClusterSpec("cpu-virtual", n, gpus_per_node=8, profile=profile)
        return evaluate(DEMO, TRAIN, cluster, lay).time_breakdown_s["dp_exposed"]

    ddp = _profile(ddp_step=7e-3)
    assert dp(2, 0, ddp) == pytest.approx(7e-3)
    env = Env(DEMO, TRAIN, ClusterSpec("cpu-virtual", 8, gpus_per_node=8, profile=ddp))
    grads = 4.0 * total_params(DEMO)  # fp32
    # One all-reduce charged per layer's latency (as the inter-node tier is, costmodel._engine_dp).
    tier = env.node_tier
    extra = env.eff.host * (DEMO.layers * (2 * 3 - 2 * 1) * tier.latency + grads * (7 / 4 - 1) / tier.bw)
    assert extra > 0 and dp(8, 0, ddp) == pytest.approx(7e-3 * env.eff.host + extra, rel=1e-9)
    # ZeRO-3 too: its units' all-gathers and reduce-scatter on 8 ranks cost more than on 2.
    fsdp = _profile(fsdp_unit=4e-3)
    assert dp(8, 3, fsdp) > dp(2, 3, fsdp) * env.eff.host / Env(
        DEMO, TRAIN, ClusterSpec("cpu-virtual", 2, gpus_per_node=8, profile=fsdp)).eff.host
