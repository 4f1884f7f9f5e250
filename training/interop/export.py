"""Export a Lattice checkpoint for use elsewhere (one process, CPU, no job needed)::

    python -m training.interop.export --checkpoints <job folder> [--step N] --format hf|torch \\
        --output DIR [--status FILE]

``hf``: ``config.json`` (``model_type: llama``, or ``mixtral`` for an MoE model) and
``model.safetensors``, loadable with ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``.
``torch``: ``model.pt`` (one consolidated canonical ``state_dict``; no ``output.weight`` when the
embeddings are tied) and ``model.json`` (the ModelSpec). Both also hold ``lattice.json`` (job step
and layout). The DCP shards are consolidated by loading them, verified, into a one-process model
built from the checkpoint's ``model.json``; the optimizer state is left out.

The output appears whole or not at all (written to ``DIR.partial``, then renamed). ``--status``
keeps a JSON status file (``running`` -> ``succeeded`` | ``failed`` with the error) for the service's
asynchronous exports. Exit code 0 on success, 2 on an error the user can fix (message on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

from training.config.layout import Layout
from training.config.spec import ModelSpec, SpecError
from training.data.confined import by_descriptor, inside, opened_path
from training.interop.names import FORMATS, SAFETENSORS, SPEC_FILE, TORCH_STATE, InteropError, hf_config

LAYOUT_FILE = "layout.json"


def write_status(path: str | os.PathLike[str] | None, **fields: Any) -> None:
    """Replace the status file atomically (readers never see half a file)."""
    if path is None:
        return
    p = Path(path)
    current: dict[str, Any] = {}
    if p.is_file():
        try:
            current = json.loads(p.read_text())
        except ValueError:
            current = {}
    current.update(fields, updated=time.time())
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(current, indent=1, sort_keys=True))
    os.replace(tmp, p)


def find_checkpoint(root: str | os.PathLike[str], step: int | None) -> Path:
    """The committed checkpoint of `step` (newest when None) under a job's checkpoint folder."""
    from training.checkpoint.manifest import list_checkpoints, step_path

    steps = list_checkpoints(Path(root))
    if not steps:
        raise InteropError(f"no committed checkpoint under {root}")
    if step is None:
        return step_path(Path(root), steps[-1])
    if step not in steps:
        raise InteropError(f"--step {step}: no checkpoint of that step; the job has steps {steps}")
    return step_path(Path(root), step)


def checkpoint_spec(ckpt: Path) -> tuple[ModelSpec, dict[str, Any]]:
    """The ModelSpec and layout stored beside the shards."""
    try:
        spec = ModelSpec.from_dict(json.loads((ckpt / SPEC_FILE).read_text()))
        layout = json.loads((ckpt / LAYOUT_FILE).read_text())
    except FileNotFoundError as e:
        raise InteropError(f"{ckpt} has no {Path(e.filename).name}: it was saved before Lattice stored "
                           f"the model spec beside the shards, and cannot be exported") from e
    except (ValueError, SpecError) as e:
        raise InteropError(f"{ckpt}: the stored model spec cannot be read: {e}") from e
    Layout.from_dict(layout)  # a stored layout that does not parse is a damaged checkpoint
    return spec, layout


def consolidated_state(ckpt: Path, spec: ModelSpec) -> dict[str, Any]:
    """The full canonical model state of a (verified) checkpoint, whatever layout saved it."""
    import torch

    from training.checkpoint.checkpointer import load_checkpoint
    from training.model.transformer import Transformer, canonical_name

    with torch.device("cpu"):
        model = Transformer(spec)
    load_checkpoint(ckpt, [model], None)
    return {canonical_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def _open_parent(out: Path, data_root: str | None) -> int:
    """A descriptor of `out`'s folder (created if missing). With `data_root` the folders are opened and
    created one at a time from the root's descriptor, never following a link: a folder replaced by a
    link after the service's check is refused before anything is created through it, and every later
    write and the final rename go through this descriptor."""
    flags = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
    if data_root is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        return os.open(out.parent, flags)
    rel = os.path.relpath(os.path.abspath(out.parent), data_root)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise InteropError(f"--output {str(out)!r} is not inside the data root")
    fd = os.open(data_root, flags)
    try:
        for part in [p for p in rel.split(os.sep) if p not in ("", os.curdir)]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, flags | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
            except OSError as e:
                if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise InteropError(f"--output {str(out)!r} now leads outside the data root (a link "
                                       "replaced a folder above it after the export was requested); choose "
                                       "another folder") from e
                raise InteropError(f"--output {str(out)!r}: {part!r} above it is not a folder") from e
            os.close(fd)
            fd = child
        if not inside(opened_path(fd, str(out.parent)), data_root):
            raise InteropError(f"--output {str(out)!r} now leads outside the data root")
    except BaseException:
        os.close(fd)
        raise
    return fd


def export_checkpoint(root: str | os.PathLike[str], step: int | None, fmt: str,
                      output: str | os.PathLike[str], data_root: str | None = None) -> dict[str, Any]:
    """Write the export of one checkpoint to `output`; returns what was written. `data_root` (the
    service's): the files must land inside it, however the folders above `output` change meanwhile."""
    if fmt not in FORMATS:
        raise InteropError(f"--format must be one of {list(FORMATS)}, got {fmt!r}")
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"--output {str(out)!r} already exists and is not an empty folder")
    ckpt = find_checkpoint(root, step)
    spec, layout = checkpoint_spec(ckpt)
    config = hf_config(spec) if fmt == "hf" else None  # refuses what has no mapping, before any work
    state = consolidated_state(ckpt, spec)
    parent = _open_parent(out, data_root)
    try:
        return _write(parent, out, fmt, spec, config, state, ckpt, layout)
    finally:
        os.close(parent)


def _write(parent: int, out: Path, fmt: str, spec: ModelSpec, config: dict[str, Any] | None,
           state: dict[str, Any], ckpt: Path, layout: dict[str, Any]) -> dict[str, Any]:
    """Write `out.partial` inside the folder `parent` (a descriptor), then rename it to `out`."""
    name = out.name + ".partial"
    shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
    os.mkdir(name, dir_fd=parent)
    folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        via_fd = by_descriptor(folder)  # the folder made above, whatever its name now leads to
        partial = Path(via_fd) if via_fd else out.with_name(name)
        info = _write_files(partial, fmt, spec, config, state, ckpt, layout)
        if out.name in os.listdir(parent):
            os.rmdir(out.name, dir_fd=parent)
        os.replace(name, out.name, src_dir_fd=parent, dst_dir_fd=parent)
        return {**info, "output": str(out), "files": sorted(os.listdir(folder))}
    finally:
        os.close(folder)


def _write_files(partial: Path, fmt: str, spec: ModelSpec, config: dict[str, Any] | None,
                 state: dict[str, Any], ckpt: Path, layout: dict[str, Any]) -> dict[str, Any]:
    if fmt == "hf":
        from safetensors.torch import save_file

        from training.interop.hf import to_hf

        save_file(to_hf(state, spec), str(partial / SAFETENSORS), metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(config, indent=1))
    else:
        import torch

        if spec.tied_embeddings:
            state.pop("output.weight", None)
        torch.save(state, partial / TORCH_STATE)
        (partial / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1, sort_keys=True))
    step_done = int(ckpt.name.split("-", 1)[1])
    info = {"format": fmt, "step": step_done, "checkpoint": str(ckpt), "layout": layout,
            "model": spec.to_dict()}
    (partial / "lattice.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.interop.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", required=True, help="the job's checkpoint folder (step-N inside)")
    parser.add_argument("--step", type=int, help="the checkpoint step; default the newest")
    parser.add_argument("--format", required=True, help="hf (Hugging Face Llama/Mixtral) or torch")
    parser.add_argument("--output", required=True, help="a new folder for the exported files")
    parser.add_argument("--status", help="a JSON status file to keep up to date")
    parser.add_argument("--data-root", help="the service's data root: the output must stay inside it")
    args = parser.parse_args(argv)
    write_status(args.status, state="running", pid=os.getpid(), started=time.time())
    from training.checkpoint.manifest import CheckpointError

    try:
        result = export_checkpoint(args.checkpoints, args.step, args.format, args.output, args.data_root)
    except (InteropError, SpecError, ValueError, OSError, CheckpointError) as e:
        write_status(args.status, state="failed", error=str(e))
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        write_status(args.status, state="failed", error=f"{type(e).__name__}: {e}")
        raise
    write_status(args.status, state="succeeded", result=result)
    print(json.dumps({k: result[k] for k in ("format", "step", "output", "files")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
