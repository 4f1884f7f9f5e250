"""The referee for DP = 2 (training.integrity.referee): a persistent flip on one replica survives the re-run
from the pre-step snapshot, the ranks write that snapshot, and one process replaying the step
alone reproduces the healthy replica's fingerprint bit for bit, which names the other one."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from training.integrity.referee import referee_supported, replay_step, verdict

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
FLIP_STEP = 3


def _cfg(ckpt: str, **layout: Any) -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(dp=2, **layout), steps=5,
                     checkpoint=CheckpointConfig(dir=ckpt, every_steps=0))


def _train_with_flip(rank: int, world: int, cfg_dict: dict, persistent: bool) -> dict:
    import torch

    from training.integrity.injection import BitFlip, BitFlipInjector
    from training.parallel.dist import DistContext
    from training.train import Action, TrainHooks, train

    errors: list[Any] = []

    class Hooks(TrainHooks):
        def on_integrity_error(self, error: Any) -> Action:
            errors.append(error)
            return Action.STOP

    hooks = Hooks()
    flip = BitFlip(step=FLIP_STEP, rank=1, target="param", name="layers.1.feed_forward.w2.weight",
                   index=7, bit=27, persistent=persistent)
    hooks.injector = BitFlipInjector([flip], rank)
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    train(ctx, RunConfig.from_dict(cfg_dict), hooks, resume=False)
    (error,) = errors
    return {"kind": error.kind, "step": error.step, "ranks": error.ranks, "evidence": error.evidence}


@pytest.fixture(scope="module")
def persistent(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, list[dict]]:
    cfg = _cfg(str(tmp_path_factory.mktemp("ckpt")))
    return cfg, run_ranks(2, _train_with_flip, (cfg.to_dict(), True))


def test_a_persistent_flip_reproduces_on_the_rerun_and_leaves_a_snapshot(persistent) -> None:
    _, errors = persistent
    for e in errors:
        assert e["kind"] == "divergent_replicas" and e["step"] == FLIP_STEP
        assert e["evidence"]["transient"] is False  # the re-run disagreed again
        assert sorted(e["ranks"]) == [0, 1]  # two replicas alone cannot say which
    referee = errors[0]["evidence"]["referee"]
    assert referee == errors[1]["evidence"]["referee"] and referee["step"] == FLIP_STEP
    assert referee["dp_group"] == [0, 1] and len(set(referee["fingerprints"].values())) == 2


def test_the_referee_reproduces_the_healthy_replica_and_names_the_other(persistent) -> None:
    cfg, errors = persistent
    referee = errors[0]["evidence"]["referee"]
    result = replay_step(cfg, referee["snapshot"])
    assert result["step"] == FLIP_STEP
    assert result["fingerprint"] == referee["fingerprints"]["0"]  # bit for bit, in another process
    prints = {int(r): f for r, f in referee["fingerprints"].items()}
    assert verdict(prints, result["fingerprint"]) == ([1], [0])


def test_a_transient_flip_is_settled_by_the_rerun_without_a_referee(tmp_path) -> None:
    errors = run_ranks(2, _train_with_flip, (_cfg(str(tmp_path)).to_dict(), False))
    for e in errors:
        assert e["ranks"] == [1] and e["evidence"]["transient"] is True
        assert "referee" not in e["evidence"]


def test_verdict_names_nobody_without_exactly_one_match() -> None:
    assert verdict({0: "a", 1: "b"}, "c") == ([], [])
    assert verdict({0: "a", 1: "a"}, "a") == ([], [0, 1])
    assert verdict({0: "a", 1: "b"}, "b") == ([0], [1])


def test_only_whole_model_dp2_layouts_are_refereed() -> None:
    assert referee_supported(Layout(dp=2, num_microbatches=2))
    assert not referee_supported(Layout(dp=3))
    assert not referee_supported(Layout(dp=2, tp=2))
    assert not referee_supported(Layout(dp=2, zero_stage=1))
