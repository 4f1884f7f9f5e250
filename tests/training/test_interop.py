"""Export to Hugging Face / torch and back: a trained Lattice model gives the same loss in
`transformers` (within 1e-4), and an import starts a job where the export ended."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, DataConfig, RunConfig
from training.config.spec import ModelSpec
from training.data.sources import TokenFileSource, write_token_file
from training.interop.export import consolidated_state, export_checkpoint, find_checkpoint
from training.interop.hf import halves_to_interleaved, interleaved_to_halves
from training.interop.names import InteropError, canonical_shapes, check_weights, hf_shapes
from training.model.transformer import Transformer, cross_entropy_loss

ROOT = Path(__file__).resolve().parents[2]
SEQ, VOCAB = 16, 96
GQA = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, seq_len=SEQ, rope_theta=5000.0,
                norm_eps=1e-6)


def _token_file(path: Path) -> Path:
    # A cycle of 12 tokens with 5% noise: learnable, so a few steps move the loss well off ln(V).
    gen = torch.Generator().manual_seed(3)
    tokens = (7 * (torch.arange(64 * SEQ) % 12) + 3) % VOCAB
    noise = torch.rand(tokens.shape, generator=gen) < 0.05
    tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=gen)
    write_token_file(path, tokens)
    return path


def _windows(path: Path, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    src = TokenFileSource(str(path), seed=0, seq_len=SEQ, vocab=VOCAB, global_batch=n)
    tokens = torch.stack([src.window_tokens(k) for k in range(n)])  # (n, SEQ + 1)
    return tokens[:, :-1], tokens[:, 1:]


def _train_rank(rank: int, world: int, cfg: RunConfig) -> list[float]:
    from training.parallel.dist import DistContext
    from training.train import train

    return train(DistContext(rank, world, torch.device("cpu"), "gloo"), cfg, resume=False).losses


def _train(spec: ModelSpec, data: Path, ckpt: Path, steps: int = 4, world: int = 1) -> list[float]:
    cfg = RunConfig(model=spec, layout=Layout(dp=world, micro_batch_size=2), steps=steps, seed=1,
                    data=DataConfig(kind="tokens", path=str(data)),
                    checkpoint=CheckpointConfig(dir=str(ckpt)))
    return run_ranks(world, _train_rank, (cfg,))[0]


def _lattice_loss(state: dict[str, torch.Tensor], spec: ModelSpec, inputs, targets) -> float:
    model = Transformer(spec)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return float(cross_entropy_loss(model(inputs), targets))


def _hf_loss(folder: Path, inputs, targets) -> float:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True,
                                                       dtype=torch.float32)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits  # (B, T, V)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def test_rotary_permutation_is_an_exact_inverse_and_matches_rotate_half():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(w, 4), 4), w)
    # Row p * hd/2 + i of a head in HF order is Lattice row 2i + p.
    hf = interleaved_to_halves(torch.arange(16.0).view(16, 1), 2).flatten().tolist()
    assert hf[:8] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_export_round_trip_matches_lattice_loss(tmp_path, tied):
    spec = ModelSpec(**{**GQA.to_dict(), "tied_embeddings": tied})
    data = _token_file(tmp_path / "tokens.bin")
    _train(spec, data, tmp_path / "ckpt")
    ckpt = find_checkpoint(tmp_path / "ckpt", None)
    assert json.loads((ckpt / "model.json").read_text()) == spec.to_dict()
    assert json.loads((ckpt / "layout.json").read_text())["micro_batch_size"] == 2
    result = export_checkpoint(tmp_path / "ckpt", None, "hf", tmp_path / "hf")
    assert result["step"] == 4 and {"config.json", "model.safetensors"} <= set(result["files"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["rope_theta"] == 5000.0 and config["tie_word_embeddings"] is tied
    inputs, targets = _windows(data)
    ours = _lattice_loss(consolidated_state(ckpt, spec), spec, inputs, targets)
    theirs = _hf_loss(tmp_path / "hf", inputs, targets)
    assert math.isfinite(ours) and abs(ours - theirs) < 1e-4, (ours, theirs)
    check_weights(spec, tmp_path / "hf", "hf")  # the export passes the submit-time shape check


def test_torch_export_is_one_state_dict_with_the_spec(tmp_path):
    data = _token_file(tmp_path / "tokens.bin")
    _train(GQA, data, tmp_path / "ckpt", steps=2)
    export_checkpoint(tmp_path / "ckpt", 2, "torch", tmp_path / "pt")
    state = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == canonical_shapes(GQA)
    assert ModelSpec.from_dict(json.loads((tmp_path / "pt" / "model.json").read_text())) == GQA
    check_weights(GQA, tmp_path / "pt", "torch")  # shapes read without torch
    other = ModelSpec(**{**GQA.to_dict(), "kv_heads": 4})
    mismatch = r"'layers.0.attention.wk.weight' has shape \[32, 64\].*\[64, 64\]"
    with pytest.raises(InteropError, match=mismatch):
        check_weights(other, tmp_path / "pt", "torch")
    with pytest.raises(InteropError, match="--step 7: no checkpoint of that step"):
        export_checkpoint(tmp_path / "ckpt", 7, "torch", tmp_path / "x")
    with pytest.raises(InteropError, match="already exists"):
        export_checkpoint(tmp_path / "ckpt", 2, "torch", tmp_path / "pt")


def test_what_cannot_be_mapped_is_refused_naming_the_field(tmp_path):
    gelu = ModelSpec(**{**GQA.to_dict(), "activation": "gelu"})
    data = _token_file(tmp_path / "tokens.bin")
    _train(gelu, data, tmp_path / "ckpt", steps=1)
    cmd = [sys.executable, "-m", "training.interop.export", "--checkpoints", str(tmp_path / "ckpt"),
           "--format", "hf", "--output", str(tmp_path / "hf"), "--status", str(tmp_path / "status.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "model.activation is 'gelu'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "hf").exists()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "failed" and "model.activation" in status["error"]
    with pytest.raises(InteropError, match="model.moe_layer_freq is 2"):
        hf_shapes(ModelSpec(**{**GQA.to_dict(), "num_experts": 4, "moe_layer_freq": 2}))


def _cfg(spec: ModelSpec, data: Path, steps: int, init=None, seed: int = 1) -> RunConfig:
    from training.config.run import InitConfig

    return RunConfig(model=spec, layout=Layout(micro_batch_size=2), steps=steps, seed=seed,
                     data=DataConfig(kind="tokens", path=str(data), seed=5),
                     init_from=InitConfig(**init) if init else None)


@pytest.mark.parametrize("fmt", ["hf", "torch"])
def test_import_starts_where_the_export_ended(tmp_path, fmt):
    from training.data.sources import make_data_source

    data = _token_file(tmp_path / "tokens.bin")
    _train(GQA, data, tmp_path / "ckpt", steps=3)
    export_checkpoint(tmp_path / "ckpt", None, fmt, tmp_path / "export")
    # A new job (another seed, another data order) from the export: its first step's loss is the
    # exported model's evaluation on that step's batch.
    cfg = _cfg(GQA, data, steps=2, init={"path": str(tmp_path / "export"), "format": fmt}, seed=9)
    (losses,) = run_ranks(1, _train_rank, (cfg,))
    inputs, targets = make_data_source(cfg.data, GQA, cfg.global_batch).batch(1, 0, 1)
    final = consolidated_state(find_checkpoint(tmp_path / "ckpt", None), GQA)
    expected = _lattice_loss(final, GQA, inputs, targets)
    assert abs(losses[0] - expected) < 1e-4, (losses[0], expected)
    (fresh,) = run_ranks(1, _train_rank, (_cfg(GQA, data, steps=1, seed=9),))
    assert abs(fresh[0] - expected) > 1e-2  # without init_from the job starts elsewhere


def test_import_refuses_a_shape_mismatch_naming_the_tensor(tmp_path):
    from training.config.run import InitConfig
    from training.interop.load import canonical_weights

    data = _token_file(tmp_path / "tokens.bin")
    _train(GQA, data, tmp_path / "ckpt", steps=1)
    export_checkpoint(tmp_path / "ckpt", None, "hf", tmp_path / "hf")
    wider = ModelSpec(**{**GQA.to_dict(), "ffn": 64})
    with pytest.raises(InteropError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[192, 64\]"):
        check_weights(wider, tmp_path / "hf", "hf")
    with pytest.raises(InteropError, match="does not exist"):
        check_weights(GQA, tmp_path / "nope", "hf")
    with pytest.raises(InteropError, match="gate_proj|w1"):
        canonical_weights(InitConfig(str(tmp_path / "hf"), "hf"), wider)


def test_moe_exports_as_mixtral_with_the_same_loss(tmp_path):
    moe = ModelSpec(**{**GQA.to_dict(), "num_experts": 4, "top_k": 2, "expert_ffn": 48,
                       "capacity_factor": None})  # Mixtral never drops tokens
    data = _token_file(tmp_path / "tokens.bin")
    _train(moe, data, tmp_path / "ckpt", steps=3)
    export_checkpoint(tmp_path / "ckpt", None, "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["num_experts_per_tok"] == 2 and config["intermediate_size"] == 48
    inputs, targets = _windows(data)
    ours = _lattice_loss(consolidated_state(find_checkpoint(tmp_path / "ckpt", None), moe), moe,
                         inputs, targets)
    theirs = _hf_loss(tmp_path / "hf", inputs, targets)
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    check_weights(moe, tmp_path / "hf", "hf")


def test_torch_shapes_never_run_code_from_the_file(tmp_path):
    import os
    import pickle
    import zipfile

    from training.interop.names import torch_shapes

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "evil.pt"
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"x": Evil()}))
    with pytest.raises(InteropError, match="not part of a plain state dict"):
        torch_shapes(bad)
    assert not marker.exists()
    good = tmp_path / "good.pt"
    torch.save({"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, good)
    assert torch_shapes(good) == {"a": (2, 3), "b": (4,)}


def test_an_export_stays_in_the_data_root_when_a_folder_above_it_is_swapped_for_a_link(
        tmp_path, monkeypatch):
    """The service passes its data root: a folder above the output replaced by a link to the service's
    home before the export starts is refused; one replaced while it writes does not redirect a byte."""
    import training.interop.export as export

    data = _token_file(tmp_path / "tokens.bin")
    _train(GQA, data, tmp_path / "ckpt", steps=1)
    root, home = tmp_path / "data", tmp_path / "home"
    (root / "exports").mkdir(parents=True)
    home.mkdir()
    (root / "old").mkdir()
    (root / "old").rename(root / "gone")
    (root / "old").symlink_to(home)  # swapped before the export starts
    with pytest.raises(InteropError, match=r"^--output .* now leads outside the data root"):
        export_checkpoint(tmp_path / "ckpt", None, "torch", root / "old" / "x", data_root=str(root))
    write_files = export._write_files  # noqa: SLF001 - the step the swap must precede

    def swap_then_write(*args, **kwargs):  # the folder above the output swapped while it writes
        (root / "exports").rename(root / "moved")
        (root / "exports").symlink_to(home)
        return write_files(*args, **kwargs)

    monkeypatch.setattr(export, "_write_files", swap_then_write)
    result = export_checkpoint(tmp_path / "ckpt", None, "torch", root / "exports" / "x", data_root=str(root))
    assert list(home.iterdir()) == []
    assert sorted(p.name for p in (root / "moved" / "x").iterdir()) == result["files"]
    assert {"model.pt", "model.json", "lattice.json"} <= set(result["files"])


def test_an_export_creates_nothing_outside_the_data_root(tmp_path):
    """Folders missing above the output are created from the data root's descriptor without following
    links: one swapped for a link to the service's home is refused before anything is made through it
    (the old code's mkdir(parents=True) made `home/new` first, then refused)."""
    data = _token_file(tmp_path / "tokens.bin")
    _train(GQA, data, tmp_path / "ckpt", steps=1)
    root, home = tmp_path / "data", tmp_path / "home"
    root.mkdir()
    home.mkdir()
    (root / "exports").symlink_to(home)
    with pytest.raises(InteropError, match=r"^--output .* now leads outside the data root"):
        export_checkpoint(tmp_path / "ckpt", None, "torch", root / "exports" / "new" / "x",
                          data_root=str(root))
    assert list(home.iterdir()) == []
    (root / "file").write_text("not a folder")
    with pytest.raises(InteropError, match=r"'file' above it is not a folder"):
        export_checkpoint(tmp_path / "ckpt", None, "torch", root / "file" / "x", data_root=str(root))
    with pytest.raises(InteropError, match=r"is not inside the data root"):
        export_checkpoint(tmp_path / "ckpt", None, "torch", tmp_path / "elsewhere" / "x", data_root=str(root))
    assert not (tmp_path / "elsewhere").exists()
    result = export_checkpoint(tmp_path / "ckpt", None, "torch", root / "a" / "b" / "x", data_root=str(root))
    written = {p.name for p in (root / "a" / "b" / "x").iterdir()}
    assert {"model.pt", "model.json"} <= set(result["files"]) == written
