"""data.validation: a held-out split the training never reads, evaluated every `every_steps`; its loss
equals an offline evaluation of the checkpoint and is the same for DP2 and TP2 x PP2."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, DataConfig, RunConfig, ValidationConfig
from training.config.spec import ModelSpec, SpecError
from training.data.sources import make_data_source, write_token_file
from training.data.validation import offline_loss, validation_source

SPEC = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=8)
DP2 = Layout(dp=2, micro_batch_size=1)
TP2_PP2 = Layout(tp=2, pp=2, micro_batch_size=1, num_microbatches=2, schedule="gpipe")


def _tokens(path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    tokens = (3 * (torch.arange(40 * 8) % 9) + 2) % 64
    noise = torch.rand(tokens.shape, generator=gen) < 0.1
    tokens[noise] = torch.randint(0, 64, (int(noise.sum()),), generator=gen)
    write_token_file(path, tokens)
    return path


def _cfg(layout: Layout, data: Path, ckpt: Path | None = None) -> RunConfig:
    val = ValidationConfig(fraction=0.25, every_steps=2, batches=3)
    return RunConfig(model=SPEC, layout=layout, steps=4, seed=2,
                     data=DataConfig(kind="tokens", path=str(data), seed=4, validation=val),
                     checkpoint=CheckpointConfig(dir=str(ckpt) if ckpt else None))


def _train_rank(rank: int, world: int, cfg: RunConfig) -> list[tuple[int, float]]:
    from training.parallel.dist import DistContext
    from training.train import TrainHooks, train

    seen: list[tuple[int, float]] = []

    class Record(TrainHooks):
        def on_validation(self, step: int, loss: float) -> None:
            seen.append((step, loss))

    train(DistContext(rank, world, torch.device("cpu"), "gloo"), cfg, Record(), resume=False)
    return seen


def test_the_held_out_windows_are_never_trained_on(tmp_path):
    cfg = _cfg(DP2, _tokens(tmp_path / "t.bin"))
    train = make_data_source(cfg.data, SPEC, cfg.global_batch)
    total = train.n_windows + train.n_heldout
    assert train.n_heldout == math.ceil(0.25 * total) and train.n_windows == total - train.n_heldout
    trained = {train.window_of(g) for g in range(3 * train.n_windows)}  # three epochs
    assert trained == set(range(train.n_windows))
    held = validation_source(cfg, train)
    assert held is not None
    first = held.batch(0, 0, 1)[0]  # the first held-out window is the first after the training ones
    assert torch.equal(first[0], train.window_tokens(train.n_windows)[:-1])
    with pytest.raises(SpecError, match="exactly one of path or fraction"):
        ValidationConfig(every_steps=2)
    with pytest.raises(SpecError, match=r"fraction must be in \(0, 1\)"):
        ValidationConfig(fraction=1.0)


def test_val_loss_every_n_steps_matches_offline_and_is_the_same_across_layouts(tmp_path):
    from training.interop.export import consolidated_state, find_checkpoint

    data = _tokens(tmp_path / "t.bin")
    dp2 = run_ranks(2, _train_rank, (_cfg(DP2, data, tmp_path / "ckpt"),))
    assert dp2[0] == dp2[1] and [s for s, _ in dp2[0]] == [2, 4]
    ckpt = find_checkpoint(tmp_path / "ckpt", 4)
    offline = offline_loss(consolidated_state(ckpt, SPEC), _cfg(DP2, data))
    assert abs(dp2[0][1][1] - offline) < 1e-5, (dp2[0], offline)
    assert dp2[0][0][1] > dp2[0][1][1]  # the model learns the cycle: held-out loss falls
    tp_pp = run_ranks(4, _train_rank, (_cfg(TP2_PP2, data),))
    assert all(r == tp_pp[0] for r in tp_pp)
    assert [s for s, _ in tp_pp[0]] == [2, 4]
    assert torch.allclose(torch.tensor([v for _, v in tp_pp[0]]), torch.tensor([v for _, v in dp2[0]]),
                          rtol=0, atol=1e-4), (tp_pp[0], dp2[0])
