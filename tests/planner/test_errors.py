"""Bad input to the planner functions: one PlannerError (a ValueError) whose message names the field."""

from __future__ import annotations

import pytest

from service.planner import (
    PRESETS,
    ClusterSpec,
    Layout,
    ModelSpec,
    PlannerError,
    TrainSpec,
    evaluate,
    get_preset,
    plan,
)
from training.config.spec import SpecError


def test_planner_error_is_a_value_error():
    assert issubclass(PlannerError, ValueError)


def test_unknown_gpu_lists_the_known_types():
    with pytest.raises(PlannerError, match=r"cluster\.gpu_type must be one of .*H100-80GB.*got 'Z100'"):
        ClusterSpec("Z100", 8)


def test_gpu_aliases_resolve():
    assert ClusterSpec("h100", 8).gpu.name == "H100-80GB"
    assert ClusterSpec("cpu", 8).gpu.name == "cpu-virtual"


def test_unknown_preset_lists_the_known_names():
    with pytest.raises(PlannerError, match="model.preset must be one of") as e:
        get_preset("gpt-5")
    assert all(name in str(e.value) for name in PRESETS)


def test_zero_layers_and_indivisible_heads_are_spec_errors():
    with pytest.raises(SpecError, match=r"model\.layers must be an integer >= 1"):
        ModelSpec(layers=0, hidden=64, heads=4, vocab=10, seq_len=8)
    with pytest.raises(SpecError, match=r"model\.hidden \(64\) must be divisible by model\.heads \(3\)"):
        ModelSpec(layers=2, hidden=64, heads=3, vocab=10, seq_len=8)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: TrainSpec(0, 128), "train.global_batch"),
        (lambda: TrainSpec(8, 0), "train.seq_len"),
        (lambda: TrainSpec(8, 128, precision="fp8"), "train.precision"),
        (lambda: ClusterSpec("H100-80GB", 0), "cluster.num_gpus"),
        (lambda: ClusterSpec("H100-80GB", 12), "cluster.num_gpus"),  # not whole nodes
        (lambda: ClusterSpec("H100-80GB", 8, nodes_per_rack=0), "cluster.nodes_per_rack"),
        (lambda: ClusterSpec("H100-80GB", 8, oversubscription=0.5), "cluster.oversubscription"),
        (lambda: ClusterSpec("H100-80GB", 8, oversubscription=float("nan")), "cluster.oversubscription"),
    ],
)
def test_bad_specs_name_the_field(make, field: str):
    with pytest.raises(PlannerError, match=field.replace(".", r"\.")):
        make()


def test_bad_search_options():
    m, t, c = get_preset("tiny"), TrainSpec(8, 32), ClusterSpec("H100-80GB", 8)
    with pytest.raises(PlannerError, match="zero_stages"):
        plan(m, t, c, zero_stages=(4,))
    with pytest.raises(PlannerError, match="zero_stages"):
        plan(m, t, c, zero_stages=())
    with pytest.raises(PlannerError, match="top_k"):
        plan(m, t, c, top_k=-1)
    with pytest.raises(PlannerError, match="model must be"):
        plan("tiny", t, c)  # type: ignore[arg-type]


def test_a_model_that_fits_nowhere_names_the_smallest_cluster_that_does():
    model, train = get_preset("llama3-70b"), TrainSpec(64, 2048)
    with pytest.raises(PlannerError, match="fits no layout on 8 H100-80GB GPUs") as e:
        plan(model, train, ClusterSpec("H100-80GB", 8))
    msg = str(e.value)
    assert "the smallest H100-80GB cluster that fits is" in msg
    smallest = int(msg.split("fits is ")[1].split()[0])
    assert plan(model, train, ClusterSpec("H100-80GB", smallest)).fits


def test_batch_too_small_for_the_cluster():
    with pytest.raises(PlannerError, match="global batch"):
        plan(get_preset("tiny"), TrainSpec(3, 32), ClusterSpec("H100-80GB", 64))


@pytest.mark.parametrize(
    "layout,field",
    [
        (Layout(dp=4), "cluster.num_gpus"),
        (Layout(dp=8, num_microbatches=2), "train.global_batch"),
        (Layout(tp=8, num_microbatches=8), "model.heads"),
        (Layout(cp=8, num_microbatches=8), "train.seq_len"),
        (Layout(pp=8, num_microbatches=8, schedule="1f1b"), "model.layers"),
        (Layout(dp=8, ep=2), "layout.ep"),
    ],
)
def test_evaluate_rejects_layouts_that_cannot_run(layout: Layout, field: str):
    model = ModelSpec(layers=4, hidden=96, heads=6, vocab=100, seq_len=36)
    with pytest.raises(PlannerError, match=field.replace(".", r"\.")):
        evaluate(model, TrainSpec(8, 36), ClusterSpec("H100-80GB", 8), layout)


def test_evaluate_reports_but_does_not_hide_a_layout_that_does_not_fit():
    p = evaluate(get_preset("llama3-70b"), TrainSpec(8, 2048), ClusterSpec("H100-80GB", 8), Layout(dp=8))
    assert not p.fits
    assert p.memory_per_gpu_bytes["total"] > p.memory_per_gpu_bytes["capacity"]
    assert any(r.startswith("does not fit") for r in p.reasons)
