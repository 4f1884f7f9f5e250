"""Token files people have: uint32 ids, folders of shards read in name order, `lattice data check`."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from typer.testing import CliRunner

from service.cli import app
from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import DataConfig, RunConfig
from training.config.spec import ModelSpec, SpecError
from training.data.sources import DataError, TokenFileSource, make_data_source, write_token_file
from training.data.token_files import inspect_tokens

SEQ = 8
BIG_VOCAB = 70_000  # beyond uint16


def _source(path, vocab=BIG_VOCAB, dtype="uint32", global_batch=2, seed=0) -> TokenFileSource:
    return TokenFileSource(str(path), seed=seed, seq_len=SEQ, vocab=vocab, global_batch=global_batch,
                           dtype=dtype)


def test_uint32_file_reads_ids_beyond_uint16(tmp_path):
    path = tmp_path / "t.bin"
    ids = [65_536 + i for i in range(SEQ + 1)] + [69_999] * SEQ
    write_token_file(path, ids, dtype="uint32")
    assert struct.unpack(f"<{len(ids)}I", path.read_bytes()) == tuple(ids)  # little-endian uint32
    src = _source(path, global_batch=1)
    assert src.n_tokens == len(ids) and src.n_windows == 2
    assert src.window_tokens(0).tolist() == ids[: SEQ + 1]
    inputs, targets = src.batch(0, 0, 1)
    assert inputs.dtype == torch.int64 and int(inputs.max()) >= 65_536
    # The same bytes read as uint16 are different tokens: the dtype is part of the source's identity.
    assert _source(path, dtype="uint16", vocab=1 << 16).fingerprint() != src.fingerprint()
    with pytest.raises(DataError, match="multiple of 4"):
        (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
        _source(tmp_path / "odd.bin")


def test_shard_folder_is_read_in_name_order_and_windows_stay_inside_a_shard(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    # Shard b has 2 windows, shard a 1 (plus a tail too short for another), c none; README is ignored.
    write_token_file(folder / "b.bin", [200 + i for i in range(2 * SEQ + 1)], dtype="uint32")
    write_token_file(folder / "a.bin", [100 + i for i in range(SEQ + 5)], dtype="uint32")
    write_token_file(folder / "c.bin", [1, 2, 3], dtype="uint32")
    (folder / "README").write_text("not tokens")
    src = _source(folder, vocab=512)
    assert [p.rsplit("/", 1)[-1] for p in src.files] == ["a.bin", "b.bin", "c.bin"]
    assert src.n_windows == 3
    windows = [src.window_tokens(k).tolist() for k in range(3)]
    assert windows[0] == list(range(100, 100 + SEQ + 1))  # a.bin first
    assert windows[1] == list(range(200, 200 + SEQ + 1))
    assert windows[2] == list(range(200 + SEQ, 200 + 2 * SEQ + 1))
    epoch = sorted(src.window_of(g) for g in range(3))
    assert epoch == [0, 1, 2]  # every window once per epoch
    with pytest.raises(DataError, match="without .bin shards"):
        empty = tmp_path / "empty"
        empty.mkdir()
        _source(empty)


def test_run_config_refuses_an_unknown_dtype():
    spec = ModelSpec(layers=1, hidden=16, heads=2, vocab=64, seq_len=SEQ)
    with pytest.raises(SpecError, match="data.dtype must be 'uint16' or 'uint32'"):
        RunConfig(model=spec, layout=Layout(), steps=1,
                  data=DataConfig(kind="tokens", path="x", dtype="int8"))


def _train_one(rank: int, world: int, cfg: RunConfig) -> list[float]:
    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    return train(ctx, cfg, resume=False).losses


def test_a_uint32_shard_folder_trains(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for name in ("000.bin", "001.bin"):
        # A repeating pattern over ids > 65535: the loss falls well below ln(V) within a few steps.
        base = 65_536 + torch.arange(16)
        tokens = base[torch.arange(40 * SEQ) % 16]
        tokens[torch.rand(tokens.shape, generator=gen) < 0.02] = 65_536
        write_token_file(folder / name, tokens, dtype="uint32")
    spec = ModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, vocab=BIG_VOCAB, seq_len=SEQ)
    cfg = RunConfig(model=spec, layout=Layout(micro_batch_size=4), steps=6, seed=0,
                    data=DataConfig(kind="tokens", path=str(folder), dtype="uint32"))
    assert make_data_source(cfg.data, spec, 4).n_windows == 2 * ((40 * SEQ - 1) // SEQ)
    (losses,) = run_ranks(1, _train_one, (cfg,))
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(BIG_VOCAB), rel=0.05)
    assert losses[-1] < losses[0] - 0.5


def _check(*args: str):
    return CliRunner().invoke(app, ["data", "check", *args], env={"COLUMNS": "200"})


def test_lattice_data_check_finds_an_id_beyond_the_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    write_token_file(path, [5, 7, 300, 2] * 10)
    ok = _check(str(path), "--vocab", "512", "--seq-len", "8")
    assert ok.exit_code == 0, ok.output
    assert "tokens   40" in ok.output and "samples  4" in ok.output and "max id   300" in ok.output
    assert "fits     yes" in ok.output
    bad = _check(str(path), "--vocab", "256", "--seq-len", "8")
    assert bad.exit_code == 1
    assert "token id 300 is beyond the vocabulary (ids < 256)" in bad.output
    wide = _check(str(path), "--vocab", "512", "--dtype", "uint32")  # 80 bytes: also a valid uint32 file
    assert wide.exit_code == 1 and "beyond the vocabulary" in wide.output  # ids read as uint32 are huge
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 6)
    wrong = _check(str(odd), "--vocab", "512", "--dtype", "uint32")
    assert wrong.exit_code == 1 and "multiple of 4" in wrong.output and "Traceback" not in wrong.output
    unknown = _check(str(path), "--vocab", "512", "--dtype", "int8")
    assert unknown.exit_code == 1 and "--dtype must be one of ['uint16', 'uint32']" in unknown.output
    missing = _check(str(tmp_path / "nope.bin"), "--vocab", "512")
    assert missing.exit_code == 1 and "cannot be read" in missing.output


def test_inspect_tokens_counts_a_shard_folder(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    write_token_file(folder / "a.bin", list(range(17)), dtype="uint32")
    write_token_file(folder / "b.bin", [99_999] * 9, dtype="uint32")
    report = inspect_tokens(folder, vocab=100_000, seq_len=8, dtype="uint32")
    got = (report.files, report.tokens, report.samples, report.max_id, report.fits)
    assert got == (2, 26, 3, 99_999, True)
