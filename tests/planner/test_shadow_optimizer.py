"""The planner charges ZeRO-1 shadow shards (fault_tolerance.shadow_optimizer) where the engine keeps
them: a second optimizer shard's memory and step, in fp32 runs without CP or EP (the measured side is
tests/training/test_memory_accounting.py's zero1_shadow case)."""

from __future__ import annotations

import pytest

from service.planner import ClusterSpec, TrainSpec, evaluate
from training.config.layout import Layout
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=96, seq_len=32, ffn=256)


def _plan(dp: int, zero: int, shadow: bool, precision: str = "fp32"):
    layout = Layout(dp=dp, zero_stage=zero, micro_batch_size=2)
    train = TrainSpec(global_batch=layout.global_batch, seq_len=SPEC.seq_len, precision=precision,
                      shadow_optimizer=shadow)
    return evaluate(SPEC, train, ClusterSpec("cpu-virtual", dp), layout)


@pytest.mark.parametrize("dp", [2, 4])
def test_shadow_adds_one_more_zero1_shard_of_optimizer_state_and_step(dp: int) -> None:
    plain, shadowed = _plan(dp, 1, False), _plan(dp, 1, True)
    memory, base = shadowed.memory_per_gpu_bytes, plain.memory_per_gpu_bytes
    assert memory["optimizer"] == pytest.approx(2 * base["optimizer"])
    assert shadowed.time_breakdown_s["optimizer"] == pytest.approx(2 * plain.time_breakdown_s["optimizer"])
    assert shadowed.memory_per_gpu_bytes["params"] == plain.memory_per_gpu_bytes["params"]


@pytest.mark.parametrize(("zero", "precision"), [(0, "fp32"), (3, "fp32"), (1, "bf16_fp32_adam")])
def test_shadow_changes_nothing_where_the_engine_keeps_none(zero: int, precision: str) -> None:
    plain, shadowed = _plan(2, zero, False, precision), _plan(2, zero, True, precision)
    assert shadowed.memory_per_gpu_bytes == plain.memory_per_gpu_bytes
    assert shadowed.step_time_s == plain.step_time_s
