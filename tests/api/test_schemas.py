"""JobSpec: its mirrors of Layout/ModelSpec stay in step, and it converts to what training runs."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from service.planner import get_preset
from service.schemas import DEMO_SPEC, EXPLICIT_SPEC, JobSpec, LayoutSpec, ModelConfig
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import ModelSpec


def test_mirrors_have_exactly_the_dataclass_fields() -> None:
    assert set(LayoutSpec.model_fields) == {f.name for f in dataclasses.fields(Layout)}
    # init_from (pretrained weights, training.interop) is where the model starts, not its shape.
    assert set(ModelConfig.model_fields) - {"init_from"} == {f.name for f in dataclasses.fields(ModelSpec)}
    assert LayoutSpec().to_layout() == Layout()


def test_preset_spec_to_run_config() -> None:
    spec = JobSpec.model_validate(DEMO_SPEC)
    assert spec.model_spec() == get_preset("demo")
    layout = Layout(dp=8)
    config = spec.to_run_config(layout, "/ckpt/job")
    assert isinstance(config, RunConfig)
    assert (config.steps, config.layout, config.optim.lr, config.checkpoint.dir) == (
        30,
        layout,
        0.003,
        "/ckpt/job",
    )
    assert (config.checkpoint.every_steps, config.checkpoint.keep, config.data.kind) == (10, 2, "synthetic")
    assert RunConfig.from_dict(config.to_dict()) == config


def test_explicit_spec_round_trips_through_its_canonical_form() -> None:
    spec = JobSpec.model_validate(EXPLICIT_SPEC)
    assert spec.explicit_layout() == Layout(tp=2, dp=2, num_microbatches=2)
    assert JobSpec.model_validate(spec.canonical()) == spec
    config = spec.to_run_config(spec.explicit_layout(), None)
    assert config.model.hidden == 64 and config.checkpoint.dir is None
    assert spec.faults[0].kind == "kill_rank" and spec.faults[0].rank == 1


def test_strict_types_and_finite_numbers() -> None:
    bad = [
        {"train": {"steps": "10", "global_batch": 4}},  # no string-to-int coercion
        {"train": {"steps": 10, "global_batch": 4, "lr": float("inf")}},
        {"checkpoint": {"async_save": 1}},
        {"faults": [{"kind": "slow_rank", "at_step": 1, "rank": 0, "factor": float("nan")}]},
    ]
    for change in bad:
        with pytest.raises(ValidationError):
            JobSpec.model_validate(EXPLICIT_SPEC | change)
