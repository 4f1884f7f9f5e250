"""training.data.sources: deterministic global batches, disjoint DP slices, resumable positions, files."""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import pytest
import torch

from training.config.run import DataConfig
from training.config.spec import ModelSpec
from training.data.sources import (
    DataError,
    SyntheticSource,
    TokenFileSource,
    make_data_source,
    write_token_file,
)

SPEC = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)
GLOBAL_BATCH = 8


def _synthetic(seed: int = 0, global_batch: int = GLOBAL_BATCH, spec: ModelSpec = SPEC) -> SyntheticSource:
    src = make_data_source(DataConfig(kind="synthetic", seed=seed), spec, global_batch)
    assert isinstance(src, SyntheticSource)
    return src


def _global_batch(src, step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [src.batch(step, r, dp) for r in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.fixture
def token_file(tmp_path):
    seq_len, n_windows = SPEC.seq_len, 10
    tokens = torch.arange(seq_len * n_windows + 5) % SPEC.vocab  # 5 spare tokens after the last window
    path = tmp_path / "train.bin"
    assert write_token_file(path, tokens) == tokens.numel()
    return path, tokens


def _tokens(path, global_batch: int = 4, seed: int = 3, spec: ModelSpec = SPEC) -> TokenFileSource:
    src = make_data_source(DataConfig(kind="tokens", path=str(path), seed=seed), spec, global_batch)
    assert isinstance(src, TokenFileSource)
    return src


def test_synthetic_batches_are_deterministic_and_seeded():
    a, b, other = _synthetic(seed=1), _synthetic(seed=1), _synthetic(seed=2)
    for step in (0, 3):
        xa, ya = a.batch(step, 0, 1)
        xb, yb = b.batch(step, 0, 1)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, other.batch(step, 0, 1)[0])
    assert not torch.equal(a.batch(0, 0, 1)[0], a.batch(1, 0, 1)[0])
    x, y = a.batch(0, 0, 2)
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (GLOBAL_BATCH // 2, SPEC.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert int(x.min()) >= 0 and int(x.max()) < SPEC.vocab


@pytest.mark.parametrize("kind", ["synthetic", "tokens"])
def test_dp_slices_are_disjoint_and_concatenate_to_the_global_batch(kind, token_file):
    src = _synthetic() if kind == "synthetic" else _tokens(token_file[0], global_batch=GLOBAL_BATCH)
    for step in (0, 2):
        reference = _global_batch(src, step, 1)
        for dp in (1, 2, 4):
            x, y = _global_batch(src, step, dp)
            assert torch.equal(x, reference[0]) and torch.equal(y, reference[1]), (step, dp)
            slices = [src.positions(step, r, dp) for r in range(dp)]
            flat = [i for s in slices for i in s]
            assert flat == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
            assert all(len(s) == GLOBAL_BATCH // dp for s in slices)
    with pytest.raises(DataError, match="must divide the global batch"):
        src.batch(0, 0, 3)
    with pytest.raises(DataError, match="dp_rank"):
        src.positions(0, 2, 2)


def test_synthetic_follows_its_rule_up_to_the_noise():
    src = _synthetic(seed=5, global_batch=32)
    x, y = src.batch(0, 0, 1)
    follows = (y == (src.a * x + src.b) % SPEC.vocab).float().mean().item()
    assert math.gcd(src.a, SPEC.vocab) == 1
    # noise p = 0.1 replaces the rule (and hits the rule's token by chance 1/V of the time)
    assert 0.85 < follows < 0.95


def test_synthetic_loss_falls_within_20_steps_on_a_small_transformer():
    from training.model.transformer import build_model, cross_entropy_loss

    torch.manual_seed(0)
    spec = ModelSpec(layers=1, hidden=32, heads=2, vocab=64, seq_len=16)
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    src = _synthetic(seed=0, global_batch=16, spec=spec)
    losses = []
    for step in range(20):
        x, y = src.batch(step, 0, 1)
        loss = cross_entropy_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 0.9 * math.log(spec.vocab)  # starts near chance
    assert sum(losses[-3:]) / 3 < 0.6 * losses[0], losses


def test_state_round_trip_resumes_without_skipping_or_repeating(token_file):
    for make in (lambda: _synthetic(), lambda: _tokens(token_file[0], global_batch=GLOBAL_BATCH)):
        first = make()
        seen = []
        for step in range(3):
            first.batch(step, 0, 1)
            seen += first.positions(step, 0, 1)
        state = first.state_dict()
        assert state["next_step"] == 3 and state["samples_consumed"] == 3 * GLOBAL_BATCH
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.next_step == 3
        for step in (3, 4):
            assert torch.equal(resumed.batch(step, 1, 2)[0], first.batch(step, 1, 2)[0])
            seen += [i for r in range(2) for i in resumed.positions(step, r, 2)]
        assert seen == list(range(5 * GLOBAL_BATCH))
        with pytest.raises(DataError, match="precedes the resumed data position"):
            resumed.batch(2, 0, 1)


def test_resume_with_another_global_batch_continues_at_the_next_sample():
    first = _synthetic(global_batch=8)
    for step in range(2):
        first.batch(step, 0, 2)
    smaller = _synthetic(global_batch=4)  # e.g. resumed on half the DP ranks
    smaller.load_state_dict(first.state_dict())
    assert smaller.positions(2, 0, 1) == [16, 17, 18, 19]
    assert smaller.positions(3, 1, 2) == [22, 23]
    # the samples themselves are a function of the global index only
    assert torch.equal(smaller.batch(2, 0, 1)[0], first.batch(2, 0, 2)[0])


def test_mismatched_resume_is_refused(token_file, tmp_path):
    state = _synthetic(seed=1).state_dict()
    with pytest.raises(DataError, match="data seed is 1, this run's is 2"):
        _synthetic(seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len is 16, this run's is 32"):
        _synthetic(seed=1, spec=replace(SPEC, seq_len=32)).load_state_dict(state)
    with pytest.raises(DataError, match="fingerprint"):
        _synthetic(seed=1, spec=replace(SPEC, vocab=128)).load_state_dict(state)
    with pytest.raises(DataError, match="data kind is 'synthetic'"):
        _tokens(token_file[0], seed=1).load_state_dict(state)
    tok_state = _tokens(token_file[0]).state_dict()
    other = tmp_path / "other.bin"
    write_token_file(other, (token_file[1] + 1) % SPEC.vocab)  # same size, other content
    with pytest.raises(DataError, match="data source differs"):
        _tokens(other).load_state_dict(tok_state)
    with pytest.raises(DataError, match="malformed"):
        _synthetic().load_state_dict({"kind": "synthetic"})


def test_token_file_windows_are_a_permutation_per_epoch(token_file):
    path, tokens = token_file
    src = _tokens(path, global_batch=5)
    assert src.memory_mapped  # memory-mapped, not read into memory
    assert src.n_windows == 10
    windows_by_epoch = []
    for epoch in range(2):
        windows = []
        for step in range(2 * epoch, 2 * epoch + 2):
            x, y = src.batch(step, 0, 1)
            for row, g in enumerate(src.positions(step, 0, 1)):
                k = src.window_of(g)
                expected = tokens[k * SPEC.seq_len: k * SPEC.seq_len + SPEC.seq_len + 1]
                assert torch.equal(x[row], expected[:-1]) and torch.equal(y[row], expected[1:])
                windows.append(k)
        assert sorted(windows) == list(range(10)), windows  # every window once per epoch
        windows_by_epoch.append(windows)
    assert windows_by_epoch[0] != windows_by_epoch[1]  # a fresh permutation each epoch
    assert src.state_dict()["epoch"] == 2
    other_seed = _tokens(path, global_batch=5, seed=4)
    assert [other_seed.window_of(i) for i in range(10)] != windows_by_epoch[0]


def test_token_file_format_and_errors(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, [1, 2, 65535, 0])
    assert struct.unpack("<4H", path.read_bytes()) == (1, 2, 65535, 0)  # nanoGPT: little-endian uint16
    with pytest.raises(DataError, match=r"\[0, 65535\]"):
        write_token_file(path, [70000])
    big_vocab = tmp_path / "big.bin"
    write_token_file(big_vocab, [SPEC.vocab + 1] * (SPEC.seq_len * 2))
    with pytest.raises(DataError, match=r"token at offset \d+ of 'big.bin' is >= model.vocab \(64\)") as bad:
        _tokens(big_vocab, global_batch=1).batch(0, 0, 1)
    assert "65" not in str(bad.value)  # the position, never the file's bytes
    short = tmp_path / "short.bin"
    write_token_file(short, list(range(SPEC.seq_len)))
    with pytest.raises(DataError, match="at least seq_len"):
        _tokens(short)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match="even size"):
        _tokens(odd)
    with pytest.raises(DataError, match="cannot be read"):
        _tokens(tmp_path / "missing.bin")
    with pytest.raises(DataError, match="data.path is required"):
        make_data_source(DataConfig(kind="tokens"), SPEC, 4)
