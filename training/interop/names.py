"""Names and shapes (torch-free): Lattice canonical tensors <-> Hugging Face Llama / Mixtral.

Lattice's canonical names are listed in training/model/transformer.py. Hugging Face's:

    model.embed_tokens.weight                        tok_embeddings.weight
    model.layers.<i>.input_layernorm.weight          layers.<i>.attention_norm.weight
    model.layers.<i>.self_attn.{q,k,v,o}_proj.weight layers.<i>.attention.{wq,wk,wv,wo}.weight (q, k permuted)
    model.layers.<i>.post_attention_layernorm.weight layers.<i>.ffn_norm.weight
    model.layers.<i>.mlp.{gate,up,down}_proj.weight  layers.<i>.feed_forward.{w1,w3,w2}.weight (Llama)
    model.layers.<i>.block_sparse_moe.gate.weight    layers.<i>.feed_forward.router.weight (Mixtral)
    model.layers.<i>.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight
                                                     feed_forward.{w_gate,w_up,w_down}[e], transposed
    model.norm.weight                                norm.weight
    lm_head.weight                                   output.weight (absent when tied)
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from training.config.spec import ModelSpec
from training.data.confined import ConfinedPathError, open_confined

FORMATS = ("hf", "torch")
SAFETENSORS = "model.safetensors"
TORCH_STATE = "model.pt"
SPEC_FILE = "model.json"


class InteropError(ValueError):
    """A model or file that cannot be mapped; the message names the field and what is allowed."""


# ---- Lattice shapes ----------------------------------------------------------------------------
def canonical_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of a full model built from `spec`, with its shape (torch-free)."""
    h, hd, kv = spec.hidden, spec.head_dim, spec.n_kv_heads
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (spec.vocab, h)}
    for i in range(spec.layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (h,)
        shapes[p + "attention.wq.weight"] = (spec.heads * hd, h)
        shapes[p + "attention.wk.weight"] = (kv * hd, h)
        shapes[p + "attention.wv.weight"] = (kv * hd, h)
        shapes[p + "attention.wo.weight"] = (h, spec.heads * hd)
        shapes[p + "ffn_norm.weight"] = (h,)
        f = p + "feed_forward."
        if spec.is_moe_layer(i):
            e, ffn = spec.num_experts, spec.expert_ffn_dim
            shapes[f + "router.weight"] = (e, h)
            if spec.activation == "swiglu":
                shapes[f + "w_gate"] = (e, h, ffn)
            shapes[f + "w_up"] = (e, h, ffn)
            shapes[f + "w_down"] = (e, ffn, h)
        else:
            shapes[f + "w1.weight"] = (spec.ffn_dim, h)
            shapes[f + "w2.weight"] = (h, spec.ffn_dim)
            if spec.activation == "swiglu":
                shapes[f + "w3.weight"] = (spec.ffn_dim, h)
    shapes["norm.weight"] = (h,)
    if not spec.tied_embeddings:
        shapes["output.weight"] = (spec.vocab, h)
    return shapes


# ---- Hugging Face ------------------------------------------------------------------------------
def check_hf_exportable(spec: ModelSpec) -> str:
    """"llama" or "mixtral", or an InteropError naming the field that has no Hugging Face mapping."""
    if spec.activation != "swiglu":
        raise InteropError(
            f"model.activation is {spec.activation!r}: only 'swiglu' maps to Hugging Face Llama/Mixtral "
            f"(export with --format torch instead)"
        )
    if not spec.is_moe:
        return "llama"
    if spec.moe_layer_freq != 1:
        raise InteropError(
            f"model.moe_layer_freq is {spec.moe_layer_freq}: Mixtral has an MoE block in every layer "
            f"(only moe_layer_freq 1 maps); export with --format torch instead"
        )
    if spec.top_k < 2:
        raise InteropError(
            f"model.top_k is {spec.top_k}: Mixtral renormalises the top-k weights, Lattice keeps the raw "
            f"probability for top_k 1 (only top_k >= 2 maps); export with --format torch instead"
        )
    return "mixtral"


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json of the Hugging Face model equal to `spec` (Llama, or Mixtral for MoE)."""
    kind = check_hf_exportable(spec)
    config: dict[str, Any] = {
        "model_type": kind,
        "architectures": ["LlamaForCausalLM" if kind == "llama" else "MixtralForCausalLM"],
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "tie_word_embeddings": spec.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "lattice_model": spec.to_dict(),  # the exact spec, for import back into Lattice
    }
    if kind == "llama":
        config.update(intermediate_size=spec.ffn_dim, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(intermediate_size=spec.expert_ffn_dim, num_local_experts=spec.num_experts,
                      num_experts_per_tok=spec.top_k, router_aux_loss_coef=spec.aux_loss_coef,
                      output_router_logits=False, sliding_window=None)
    return config


def hf_name(name: str) -> str:
    """The Hugging Face name of a canonical tensor (MoE expert stacks: use `hf_expert_names`)."""
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, i, rest = name.split(".", 2)
    table = {
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.router.weight": "block_sparse_moe.gate.weight",
    }
    if rest not in table:
        raise InteropError(f"tensor {name!r} has no Hugging Face name")
    return f"model.layers.{i}.{table[rest]}"


EXPERT_HF = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def hf_expert_name(name: str, expert: int) -> str:
    """layers.<i>.feed_forward.w_up, expert e -> model.layers.<i>.block_sparse_moe.experts.<e>.w3.weight"""
    _, i, _, which = name.split(".")
    return f"model.layers.{i}.block_sparse_moe.experts.{expert}.{EXPERT_HF[which]}.weight"


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint of `spec`, with its shape."""
    check_hf_exportable(spec)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in canonical_shapes(spec).items():
        if name.split(".")[-1] in EXPERT_HF:
            for e in range(shape[0]):
                out[hf_expert_name(name, e)] = (shape[2], shape[1])  # (out, in): the transpose
        else:
            out[hf_name(name)] = shape
    return out


# ---- shapes inside files, without torch -------------------------------------------------------
def safetensors_shapes(path: str | os.PathLike[str], f: BinaryIO | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (8-byte little-endian length, then JSON), read from `f`
    when given (an open file: what was checked is what is read), else from `path`."""
    try:
        with open(path, "rb") if f is None else contextlib.nullcontext(f) as src:
            (length,) = struct.unpack("<Q", src.read(8))
            if length > 100 << 20:
                raise InteropError(f"{path}: safetensors header of {length} bytes is not plausible")
            header = json.loads(src.read(length))
    except (OSError, struct.error, ValueError) as e:
        raise InteropError(f"{path} is not a readable safetensors file: {e}") from e
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


class _Shape:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


class _ShapeUnpickler(pickle.Unpickler):
    """Reads a torch.save'd state dict's tensor shapes without torch and without running any code:
    only the constructors torch.save emits are resolved, to inert placeholders."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return dict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return lambda storage, offset, size, *rest: _Shape(tuple(size))
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, *rest: data
        if module == "torch" and (name.endswith("Storage") or name in {"float32", "bfloat16", "float16"}):
            return name
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain state dict")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def torch_shapes(path: str | os.PathLike[str], f: BinaryIO | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a torch.save'd flat state dict (zip format) read without torch, from `f` when
    given (an open file), else from `path`."""
    try:
        with zipfile.ZipFile(path if f is None else f) as z:
            pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
            with z.open(pkl) as member:
                state = _ShapeUnpickler(member).load()
    except (OSError, zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError) as e:
        raise InteropError(f"{path} is not a torch state dict Lattice can read: {e}") from e
    if not isinstance(state, dict):
        raise InteropError(f"{path} holds a {type(state).__name__}, not a state dict")
    return {k: v.shape for k, v in state.items() if isinstance(v, _Shape)}


def weights_file(path: str | os.PathLike[str], fmt: str) -> Path:
    """The weights file of an export folder (or the file itself)."""
    if fmt not in FORMATS:
        raise InteropError(f"model.init_from.format must be one of {list(FORMATS)}, got {fmt!r}")
    p = Path(path)
    target = p / (SAFETENSORS if fmt == "hf" else TORCH_STATE) if p.is_dir() else p
    if not target.is_file():
        raise InteropError(f"model.init_from.path {str(target)!r} does not exist")
    return target


@contextlib.contextmanager
def opened_weights(target: Path, root: str | None) -> Iterator[BinaryIO]:
    """The weights file `target` (weights_file's) opened as training.data.confined opens it: a regular
    file, inside `root` when given. Its refusal, and an OS error while it is read, as InteropError."""
    try:
        with open_confined(target, root, "model.init_from.path") as f:
            yield f
    except ConfinedPathError as e:
        raise InteropError(str(e)) from e
    except OSError as e:
        raise InteropError(f"model.init_from.path {str(target)!r} cannot be read") from e


def check_weights(spec: ModelSpec, path: str | os.PathLike[str], fmt: str, root: str | None = None) -> None:
    """Refuse weights whose tensors do not match `spec`, naming the first mismatch (torch-free). The
    file is read as opened (training.data.confined): a regular file, inside `root` when given, so a
    link or a FIFO swapped in after the path was resolved is refused instead of followed or waited on."""
    target = weights_file(path, fmt)
    if fmt == "hf":
        check_hf_exportable(spec)
    with opened_weights(target, root) as f:
        if fmt == "hf":
            expected, found = hf_shapes(spec), safetensors_shapes(target, f)
        else:
            expected, found = canonical_shapes(spec), torch_shapes(target, f)
    for name, shape in expected.items():
        if name not in found:
            raise InteropError(f"model.init_from: {target} has no tensor {name!r} that the model needs")
        if tuple(found[name]) != tuple(shape):
            raise InteropError(
                f"model.init_from: tensor {name!r} has shape {list(found[name])} in {target}, "
                f"the model spec needs {list(shape)}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise InteropError(f"model.init_from: {target} has tensor {extra[0]!r} the model does not have")
