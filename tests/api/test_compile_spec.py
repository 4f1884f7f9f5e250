"""`train.compile` in a job spec: opt-in (default off), validated, carried to the ranks' RunConfig."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from service.schemas import DEMO_SPEC, JobSpec
from training.config.layout import Layout
from training.config.run import RunConfig
from training.config.spec import SpecError
from training.run import run_config_from_job


def _with_train(**train: object) -> dict:
    spec = copy.deepcopy(DEMO_SPEC)
    spec["train"] = {**spec["train"], **train}
    return spec


def test_compile_is_off_unless_the_job_asks() -> None:
    assert JobSpec.model_validate(DEMO_SPEC).to_run_config(Layout(dp=8), None).compile is False
    config = JobSpec.model_validate(_with_train(compile=True)).to_run_config(Layout(dp=8), None)
    assert config.compile is True and config.compile_backend == "inductor"
    assert RunConfig.from_dict(config.to_dict()) == config


def test_compile_must_be_a_boolean() -> None:
    with pytest.raises(ValidationError) as e:
        JobSpec.model_validate(_with_train(compile="yes"))
    assert any(err["loc"][-2:] == ("train", "compile") for err in e.value.errors())


def test_training_run_reads_train_compile() -> None:
    job = {"model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "train": {"steps": 2, "global_batch": 2, "compile": True}}
    assert run_config_from_job(job, world_size=1).compile is True
    job["train"]["compile"] = "true"
    with pytest.raises(SpecError, match="train.compile"):
        run_config_from_job(job, world_size=1)
