"""`train.compile: true` (training.parallel.compile): the compiled model trains like the eager one,
and compiling changes no name, so fingerprints, digests and checkpoints are those of the eager model.

The fast tests compile with the `aot_eager` backend (traced forward and backward graphs, no code
generation); the inductor test (C++ code generation on CPU) is slow.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, OptimConfig, RunConfig
from training.config.spec import ModelSpec, SpecError

SPEC = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=64)
STEPS = 3


def _config(compile_on: bool, backend: str, ckpt: str | None = None, recompute: str = "none") -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(micro_batch_size=2, num_microbatches=2, recompute=recompute),
                     steps=STEPS, seed=3, optim=OptimConfig(lr=3e-3, eps=1e-5),
                     checkpoint=CheckpointConfig(dir=ckpt), compile=compile_on, compile_backend=backend)


def _train(cfg: RunConfig, save: bool = False) -> dict:
    from training.parallel.compile import is_compiled
    from training.parallel.dist import DistContext
    from training.train import Trainer

    torch.manual_seed(0)
    trainer = Trainer(DistContext(0, 1, torch.device("cpu"), "gloo"), cfg)
    losses = [trainer.train_step(step)[0] for step in range(1, STEPS + 1)]
    if save:
        trainer.save()
        trainer.checkpointer.wait_pending()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: SLF001 - graphs traced so far
    out = {"losses": losses, "keys": sorted(trainer.parts[0].state_dict()), "graphs": graphs,
           "compiled": is_compiled(trainer.parts[0]), "digest": trainer.digest(),
           "state": {k: v.tolist() for k, v in trainer.full_state().items()}}
    trainer.close()
    return out


def _compile_vs_eager(rank: int, world: int, backend: str, recompute: str, ckpt: str) -> dict:
    eager = _train(_config(False, backend, recompute=recompute))
    compiled = _train(_config(True, backend, ckpt=ckpt, recompute=recompute), save=True)
    # The compiled run's checkpoint restores into an eager model under the same names.
    from training.parallel.dist import DistContext
    from training.train import Trainer

    restored = Trainer(DistContext(0, 1, torch.device("cpu"), "gloo"), _config(False, backend, ckpt=ckpt))
    step = restored.restore()
    return {"eager": eager, "compiled": compiled, "restored_step": step, "restored_digest": restored.digest()}


def _check(out: dict, atol: float) -> None:
    eager, compiled = out["eager"], out["compiled"]
    assert compiled["compiled"] and not eager["compiled"]
    assert eager["graphs"] == 0 and compiled["graphs"] > 0  # dynamo traced the compiled model
    assert compiled["keys"] == eager["keys"]
    assert not any("_orig_mod" in k for k in compiled["keys"])
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=atol)
    for name, value in eager["state"].items():
        assert torch.allclose(torch.tensor(compiled["state"][name]), torch.tensor(value), atol=atol), name
    # The checkpoint written with compile on loads into the eager model: same names, same tensors.
    assert out["restored_step"] == STEPS
    assert out["restored_digest"] == compiled["digest"]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compile_trains_like_eager_and_keeps_names(tmp_path, recompute: str) -> None:
    [out] = run_ranks(1, _compile_vs_eager, args=("aot_eager", recompute, str(tmp_path / "ckpt")))
    _check(out, atol=1e-5)


@pytest.mark.slow
def test_compile_inductor_same_loss(tmp_path) -> None:
    [out] = run_ranks(1, _compile_vs_eager, args=("inductor", "selective", str(tmp_path / "ckpt")),
                      timeout_s=900)
    _check(out, atol=1e-4)


def test_tensor_parallel_keeps_the_model_eager() -> None:
    from training.model.transformer import build_model
    from training.parallel.compile import apply_compile, is_compiled

    model = build_model(SPEC, 0)
    assert apply_compile(model, True, "eager", tp=2) is False and not is_compiled(model)
    assert apply_compile(model, False, "eager") is False and not is_compiled(model)
    assert apply_compile(model, True, "eager") is True and is_compiled(model)


def test_compile_backend_is_validated() -> None:
    with pytest.raises(SpecError, match="compile_backend"):
        _config(True, "tensorrt")


def _layouts_compile_vs_eager(rank: int, world: int, layouts: list[dict]) -> list[tuple[list, list]]:
    from training.parallel.dist import DistContext
    from training.train import Trainer

    out = []
    for lay in layouts:
        runs = []
        for compile_on in (False, True):
            cfg = RunConfig(model=SPEC, layout=Layout(**lay), steps=STEPS, seed=3, compile=compile_on,
                            optim=OptimConfig(lr=3e-3, eps=1e-5), compile_backend="aot_eager")
            trainer = Trainer(DistContext(rank, world, torch.device("cpu"), "gloo"), cfg)
            runs.append([trainer.train_step(step)[0] for step in range(1, STEPS + 1)])
            trainer.close()
        out.append((runs[0], runs[1]))
    return out


def test_compile_under_data_parallel_trains_like_eager() -> None:
    """The DDP wrapper calls the compiled model; its gradient hooks fire from the compiled backward."""
    [out, _] = run_ranks(2, _layouts_compile_vs_eager, args=([{"dp": 2, "zero_stage": 1}],))
    for eager, compiled in out:
        assert compiled == pytest.approx(eager, abs=1e-5)


@pytest.mark.slow
def test_compile_under_every_parallel_form_trains_like_eager() -> None:
    layouts = [{"dp": 2, "zero_stage": 3}, {"cp": 2}, {"pp": 2, "schedule": "1f1b", "num_microbatches": 2},
               {"tp": 2, "sequence_parallel": True}]  # TP: compile is skipped (apply_compile), still trains
    [out, _] = run_ranks(2, _layouts_compile_vs_eager, args=(layouts,), timeout_s=900)
    for lay, (eager, compiled) in zip(layouts, out, strict=True):
        assert compiled == pytest.approx(eager, abs=1e-5), lay
