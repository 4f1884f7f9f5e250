"""The ranks check the file they opened, not its name (training.data.confined): a token file, a
shard, held-out data or `model.init_from` weights that a link replaced after the submit check (the
file itself, a folder above it, or a shard added to a folder) is refused naming the field; a FIFO
does not block the rank. Without a root (a local run) links are followed as before."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config.layout import Layout
from training.config.run import DataConfig, InitConfig, RunConfig, ValidationConfig
from training.config.spec import ModelSpec
from training.data.confined import ConfinedPathError, open_confined
from training.data.sources import DataError, TokenFileSource, make_data_source
from training.data.validation import validation_source
from training.interop.load import canonical_weights
from training.interop.names import InteropError

VOCAB, SEQ = 64, 16
SPEC = ModelSpec(layers=1, hidden=16, heads=2, vocab=VOCAB, seq_len=SEQ)


@pytest.fixture
def layout(tmp_path: Path) -> tuple[str, Path, Path]:
    """(real data root, a valid token file in it, the service's secret outside it)."""
    root = tmp_path / "data"
    root.mkdir()
    good = root / "train.bin"
    (np.arange(4096) % VOCAB).astype(np.uint16).tofile(good)
    secret = tmp_path / "home" / "token"
    secret.parent.mkdir()
    secret.write_text("s3cret-token-bytes" * 8)
    return os.path.realpath(root), good, secret


def _swap_for_link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def test_a_regular_file_inside_the_root_opens(layout: tuple[str, Path, Path]) -> None:
    root, good, _ = layout
    with open_confined(good, root, "data.path") as f:
        assert f.read(4) == good.read_bytes()[:4]
    src = TokenFileSource(str(good), 0, SEQ, VOCAB, 4, root=root)
    assert src.n_tokens == 4096


def test_a_link_swapped_in_after_the_check_is_refused(layout: tuple[str, Path, Path]) -> None:
    root, good, secret = layout
    _swap_for_link(good, secret)
    with pytest.raises(ConfinedPathError, match=r"^data.path .* now leads outside the data root"):
        open_confined(good, root, "data.path")
    with pytest.raises(DataError, match="now leads outside the data root") as e:
        make_data_source(DataConfig(kind="tokens", path=str(good), root=root), SPEC, 4)
    assert "s3cret" not in str(e.value)
    # a local run (no root) follows links, as open() does
    with open_confined(good, None, "data.path") as f:
        assert f.read().startswith(b"s3cret")


def test_a_folder_above_the_file_replaced_by_a_link_is_refused(layout: tuple[str, Path, Path]) -> None:
    root, _, secret = layout
    sub = Path(root) / "corpus"
    sub.mkdir()
    shard = sub / "000.bin"
    (np.arange(2048) % VOCAB).astype(np.uint16).tofile(shard)
    assert TokenFileSource(str(sub), 0, SEQ, VOCAB, 4, root=root).n_tokens == 2048
    outside = secret.parent / "corpus"
    outside.mkdir()
    (outside / "000.bin").write_bytes(secret.read_bytes())
    sub.rename(Path(root) / "corpus.old")
    sub.symlink_to(outside)  # the resolved folder path now goes through a link out of the root
    with pytest.raises(DataError, match=r"data.path .*000.bin' now leads outside the data root"):
        TokenFileSource(str(sub), 0, SEQ, VOCAB, 4, root=root)


def test_a_shard_link_added_to_a_checked_folder_is_refused(layout: tuple[str, Path, Path]) -> None:
    root, _, secret = layout
    sub = Path(root) / "shards"
    sub.mkdir()
    (np.arange(2048) % VOCAB).astype(np.uint16).tofile(sub / "000.bin")
    (sub / "001.bin").symlink_to(secret)
    with pytest.raises(DataError, match=r"001.bin' now leads outside the data root"):
        TokenFileSource(str(sub), 0, SEQ, VOCAB, 4, root=root)


def test_held_out_data_is_checked_as_opened(layout: tuple[str, Path, Path]) -> None:
    root, good, secret = layout
    held = Path(root) / "val.bin"
    (np.arange(1024) % VOCAB).astype(np.uint16).tofile(held)
    spec = SPEC
    data = DataConfig(kind="tokens", path=str(good), root=root,
                      validation=ValidationConfig(path=str(held), every_steps=1))
    cfg = RunConfig(model=spec, layout=Layout(dp=1, micro_batch_size=4), data=data, steps=1)
    train = make_data_source(cfg.data, spec, cfg.global_batch)
    assert validation_source(cfg, train) is not None
    _swap_for_link(held, secret)
    with pytest.raises(DataError, match=r"^data.validation.path .* now leads outside the data root"):
        validation_source(cfg, train)


def test_a_fifo_is_refused_without_blocking(layout: tuple[str, Path, Path]) -> None:
    root, good, _ = layout
    good.unlink()
    os.mkfifo(good)
    outcome: list[BaseException] = []

    def attempt() -> None:
        for opener in (lambda: open_confined(good, root, "data.path"),  # the open itself
                       lambda: TokenFileSource(str(good), 0, SEQ, VOCAB, 4, root=root)):
            try:
                opener()
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():  # unblock the reader so the thread ends, then fail
        with open(good, "wb"):
            pass
        pytest.fail("opening a FIFO blocked the rank")
    assert [type(e) for e in outcome] == [ConfinedPathError, DataError], outcome
    assert str(outcome[0]).endswith("is not a regular file") and str(outcome[1]).startswith("data.path ")


def test_init_from_weights_are_checked_as_opened(layout: tuple[str, Path, Path]) -> None:
    root, _, secret = layout
    spec = SPEC
    from training.model.transformer import Transformer, canonical_name

    torch.manual_seed(0)
    state = {canonical_name(k): v for k, v in Transformer(spec).state_dict().items()}
    folder = Path(root) / "init"
    folder.mkdir()
    torch.save(state, folder / "model.pt")
    loaded = canonical_weights(InitConfig(path=str(folder), format="torch", root=root), spec)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    torch.save(state, secret.parent / "model.pt")
    _swap_for_link(folder / "model.pt", secret.parent / "model.pt")
    with pytest.raises(InteropError, match=r"^model.init_from.path .* now leads outside the data root"):
        canonical_weights(InitConfig(path=str(folder), format="torch", root=root), spec)


@pytest.mark.parametrize("swap", ["link", "fifo"])
def test_the_submit_time_shape_check_reads_what_it_opened(layout: tuple[str, Path, Path], swap: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's shape check of `model.init_from` (training.interop.names.check_weights, on an API
    thread): a link or a FIFO swapped in just after the weights' name was checked is refused, naming
    the field; the FIFO does not hold the thread (on the old code it waited for a writer)."""
    import training.interop.names as names
    from training.model.transformer import Transformer, canonical_name

    root, _, secret = layout
    torch.manual_seed(0)
    state = {canonical_name(k): v for k, v in Transformer(SPEC).state_dict().items()}
    folder = Path(root) / "init"
    folder.mkdir()
    torch.save(state, folder / "model.pt")
    names.check_weights(SPEC, folder, "torch", root)  # the file as it was submitted passes
    torch.save(state, secret.parent / "model.pt")
    checked_name = names.weights_file

    def swapped_after_the_name_check(path: str, fmt: str) -> Path:
        target = checked_name(path, fmt)
        target.unlink()
        if swap == "link":
            target.symlink_to(secret.parent / "model.pt")
        else:
            os.mkfifo(target)
        return target

    monkeypatch.setattr(names, "weights_file", swapped_after_the_name_check)
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            names.check_weights(SPEC, folder, "torch", root)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        with open(folder / "model.pt", "wb"):
            pass
        pytest.fail("the shape check blocked on a FIFO")
    expected = "now leads outside the data root" if swap == "link" else "is not a regular file"
    assert [type(e) for e in outcome] == [InteropError], outcome
    assert str(outcome[0]).startswith("model.init_from.path ") and expected in str(outcome[0])
