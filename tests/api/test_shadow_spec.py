"""`fault_tolerance.shadow_optimizer` in the job spec: it reaches the ranks' RunConfig, and a spec whose
given fields rule shadow shards out (ZeRO-2/3, CP, EP, bf16) is refused naming the field, not run
silently without the protection it asked for."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.schemas import JobSpec
from tests.api.specs import tiny
from training.config.layout import Layout


@pytest.mark.parametrize(("field", "value", "named"), [
    ("parallelism", {"dp": 2, "zero_stage": 3}, "parallelism.zero_stage is 3"),
    ("parallelism", {"dp": 2, "cp": 2}, "parallelism.cp is 2"),
    ("train", {"steps": 10, "global_batch": 4, "precision": "bf16_fp32_adam"},
     "train.precision is bf16_fp32_adam"),
])
def test_shadow_optimizer_refuses_a_spec_it_cannot_protect(field: str, value: dict, named: str) -> None:
    with pytest.raises(ValidationError, match="fault_tolerance.shadow_optimizer") as e:
        JobSpec.model_validate(tiny(fault_tolerance={"shadow_optimizer": True}, **{field: value}))
    assert named in str(e.value)
    JobSpec.model_validate(tiny(**{field: value}))  # without shadows the same spec is fine


def test_shadow_optimizer_reaches_the_ranks_with_zero1_or_a_layout_left_to_the_planner() -> None:
    for parallelism in ({"dp": 2, "zero_stage": 1}, {"dp": 2}):
        spec = JobSpec.model_validate(tiny(fault_tolerance={"shadow_optimizer": True},
                                           parallelism=parallelism))
        assert spec.to_run_config(Layout(dp=2, zero_stage=1), None).shadow_optimizer is True
