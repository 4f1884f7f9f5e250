"""Checkpoints with torch.distributed.checkpoint (DCP): atomic commit, verified load, resharding.

Layout of a checkpoint root (a directory every rank sees: local disk for one host, a shared
filesystem for several)::

    <root>/
      step-40/              a committed checkpoint of step 40
        .metadata           DCP's global metadata: which file holds which chunk of which key
        __0_0.distcp ...    DCP data files, written by every rank: model and optimizer tensors
        rng/rank-0.pt ...   each rank's RNG states (torch CPU + CUDA, python `random`, numpy if present)
        meta.json           format, step, world size, time, and the caller's `extra` (data position)
        manifest.json       sha256 + size of every other file; written last
      step-50.tmp/          a save in progress, or one that crashed: ignored by list and load
      step-30.trash/        being deleted (pruned or replaced): ignored

DCP keys are canonical FQNs, independent of the layout: ``model.<fqn>`` for parameters and
buffers, ``optim.state.<fqn>.<name>`` and ``optim.param_groups.<fqn>.<hyper>`` for the optimizer
(plain, ZeRO-1, FSDP2 and TP alike; see ``training.checkpoint.state``), so DCP reshards a
checkpoint to another DP size, ZeRO stage or TP degree by name.

Commit protocol of ``save_checkpoint`` (all ranks of ``process_group`` call it):
 1. rank 0 clears a leftover ``step-N.tmp/`` and creates it; barrier;
 2. every rank writes its RNG file, rank 0 writes ``meta.json`` (both fsynced), then ``dcp.save``
    writes the tensors (DCP fsyncs its files);
 3. barrier; the ranks hash the files (split between them), rank 0 writes ``manifest.json``,
    fsyncs it and the directory, renames ``step-N.tmp`` to ``step-N`` and fsyncs the root: the
    rename is the commit point, so a crash leaves either the previous checkpoints or the new one
    whole; then it prunes to the newest ``keep`` checkpoints. Its outcome is broadcast so that every
    rank returns or raises together.

With ``async_save=True``, step 2's tensors are staged (copied to CPU memory) before the call
returns and written by a background thread (``dcp.async_save``) over a dedicated gloo group, so
training continues meanwhile. Step 3 runs in ``wait_pending()``: the checkpoint is committed (and
only then visible to ``list_checkpoints``/loads) when the ranks next call ``wait_pending()``,
``save_checkpoint`` or a load function, all of which wait for the write to finish first. The
train loop calls ``wait_pending()`` before it exits.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint.state import (
    OptimizerArg,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_pairs,
    optimizer_state,
    rng_state,
    set_rng_state,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
RNG_DIR = "rng"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER_DIR = re.compile(r"^step-\d+\.(tmp|trash)$")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not match its manifest (or it has none); the message names the file."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    bytes: int
    manifest_digest: str  # sha256 of manifest.json; "" while an async save is not committed
    seconds: float  # wall time of the save (for async: until the call returned, or until commit)
    committed: bool = True


@dataclass(frozen=True)
class ManifestEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, ManifestEntry]
    digest: str  # sha256 of the manifest file itself
    created: float = 0.0
    world_size: int = 1

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.files.values())


@dataclass
class _PendingSave:
    step: int
    tmp: Path
    final: Path
    root: Path
    keep: int
    future: Future
    process_group: Any
    started: float


_pending: _PendingSave | None = None  # at most one async save in flight per process
_async_groups: dict[tuple[int, ...], tuple[Any, Any]] = {}  # ranks -> (WORLD it was made in, group)


# ----------------------------------------------------------------------------------------------
# process-group helpers (everything degrades to one process when torch.distributed is not up)
# ----------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank(pg: Any) -> int:
    return dist.get_rank(pg) if _distributed() else 0


def _world(pg: Any) -> int:
    return dist.get_world_size(pg) if _distributed() else 1


def _global_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier(pg: Any) -> None:
    if _distributed():
        dist.barrier(group=pg)


def _broadcast_from_0(value: Any, pg: Any) -> Any:
    if not _distributed() or _world(pg) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=pg, group_src=0)
    return box[0]


def _all_gather(value: Any, pg: Any) -> list[Any]:
    if not _distributed() or _world(pg) == 1:
        return [value]
    out: list[Any] = [None] * _world(pg)
    dist.all_gather_object(out, value, group=pg)
    return out


@contextmanager
def _dcp_call() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _run_on_rank0(fn: Any, pg: Any, error: type[Exception] = CheckpointError) -> Any:
    """Run fn on rank 0 of the group; every rank returns its result or raises `error` together."""
    outcome: tuple[bool, Any] = (True, None)
    failure: Exception | None = None
    if _rank(pg) == 0:
        try:
            outcome = (True, fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            failure = e
            outcome = (False, str(e) if isinstance(e, error) else f"{type(e).__name__}: {e}")
    ok, value = _broadcast_from_0(outcome, pg)
    if not ok:
        raise error(value) from failure
    return value


# ----------------------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _data_files(ckpt: Path) -> list[str]:
    """Every file of a checkpoint except the manifest, as sorted POSIX paths relative to it."""
    return sorted(
        p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def _step_path(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def list_checkpoints(root: str | os.PathLike[str]) -> list[int]:
    """Steps of the committed checkpoints under root, ascending (``.tmp``/``.trash`` are ignored)."""
    base = Path(root)
    if not base.is_dir():
        return []
    steps = [int(m.group(1)) for p in base.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps)


def verify_checkpoint(path: str | os.PathLike[str]) -> Manifest:
    """Check every file against manifest.json; raise CheckpointCorrupt naming the first bad file."""
    ckpt = Path(path)
    manifest_path = ckpt / MANIFEST
    try:
        raw = manifest_path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointCorrupt(f"{ckpt}: {MANIFEST} is missing (the checkpoint was never committed)") from e
    except OSError as e:
        raise CheckpointCorrupt(f"{ckpt}: {MANIFEST} cannot be read: {e}") from e
    try:
        doc = json.loads(raw)
        files = {name: ManifestEntry(int(e["size"]), str(e["sha256"])) for name, e in doc["files"].items()}
        manifest = Manifest(
            step=int(doc["step"]), files=files, digest=hashlib.sha256(raw).hexdigest(),
            created=float(doc.get("created", 0.0)), world_size=int(doc.get("world_size", 1)),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointCorrupt(f"{ckpt}: {MANIFEST} is malformed: {e!r}") from e
    if not files:
        raise CheckpointCorrupt(f"{ckpt}: {MANIFEST} lists no files")
    for name, entry in sorted(files.items()):
        file = ckpt / name
        if not file.is_file():
            raise CheckpointCorrupt(f"{ckpt}: file {name} is missing (listed in {MANIFEST})")
        size = file.stat().st_size
        if size != entry.size:
            raise CheckpointCorrupt(f"{ckpt}: file {name} has {size} bytes, the manifest says {entry.size}")
        if _sha256(file) != entry.sha256:
            raise CheckpointCorrupt(f"{ckpt}: file {name} is damaged (its sha256 differs from the manifest)")
    return manifest


def corrupt_checkpoint(path: str | os.PathLike[str], which: str = "any", mode: str = "flip") -> str:
    """Damage one file of a checkpoint, for fault tests; returns its path relative to the checkpoint.

    which: "any" (the first DCP data file), "metadata" (DCP's .metadata), "manifest", or a relative
    file name. mode: "flip" (invert 16 bytes in the middle, same size), "truncate" (drop the second
    half) or "delete".
    """
    ckpt = Path(path)
    if which == "any":
        shards = sorted(p.name for p in ckpt.glob("*.distcp"))
        if not shards:
            raise FileNotFoundError(f"{ckpt} has no DCP data file to damage")
        name = shards[0]
    elif which == "metadata":
        name = ".metadata"
    elif which == "manifest":
        name = MANIFEST
    else:
        name = which
    target = ckpt / name
    if not target.is_file():
        raise FileNotFoundError(f"{target} does not exist")
    if mode == "delete":
        target.unlink()
    elif mode == "truncate":
        size = target.stat().st_size
        os.truncate(target, size // 2)
    elif mode == "flip":
        data = bytearray(target.read_bytes())
        if not data:
            raise ValueError(f"{target} is empty: nothing to flip")
        mid = len(data) // 2
        for i in range(mid, min(mid + 16, len(data))):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        raise ValueError(f"mode must be 'flip', 'truncate' or 'delete', got {mode!r}")
    log.info("damaged %s (%s)", target, mode)
    return name


def _rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank-{rank}.pt"


# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------
def _async_group(pg: Any) -> Any:
    """A gloo group over pg's ranks for the background writer, so it never races the training
    collectives on pg (created once per rank set and process-group lifetime, by those ranks only)."""
    ranks = tuple(dist.get_process_group_ranks(pg or dist.group.WORLD))
    world = dist.group.WORLD
    cached = _async_groups.get(ranks)
    if cached is None or cached[0] is not world:  # none yet, or torch.distributed was re-initialised
        group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
        cached = _async_groups[ranks] = (world, group)
    return cached[1]


def save_checkpoint(
    root: str,
    step: int,
    model_parts: list[nn.Module],
    optimizer: OptimizerArg,
    extra: dict[str, Any],
    *,
    keep: int = 3,
    async_save: bool = False,
    process_group: Any = None,
) -> CheckpointInfo:
    """Save step ``step`` under ``root/step-<step>/`` (see the module docstring); every rank calls.

    ``extra`` must be JSON-serialisable (put the data position there: ``{"data": ds.state_dict()}``).
    ``optimizer`` is one optimizer per model part (or None). With async_save the result has
    ``committed=False``; ``wait_pending()`` returns the committed info.
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    try:
        meta = json.dumps(
            {"format": FORMAT_VERSION, "step": step, "world_size": _world(process_group),
             "created": time.time(), "extra": extra},
            indent=1, sort_keys=True,
        ).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from e
    wait_pending()
    started = time.perf_counter()
    base = Path(root)
    tmp, final = base / f"step-{step}.tmp", _step_path(base, step)

    def prepare() -> None:
        base.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / RNG_DIR).mkdir(parents=True)

    state = {"model": model_state(model_parts)}  # before touching the disk: bad arguments raise here
    optim_state = optimizer_state(optimizer_pairs(model_parts, optimizer))
    if optim_state:
        state["optim"] = optim_state
    _run_on_rank0(prepare, process_group)
    _write_durable(_rng_file(tmp, _global_rank()), _torch_bytes(rng_state()))
    if _rank(process_group) == 0:
        _write_durable(tmp / META, meta)
    try:
        if async_save:
            group = _async_group(process_group) if _distributed() else None
            with _dcp_call():
                response = dcp.async_save(
                    state, checkpoint_id=str(tmp), process_group=group, no_dist=not _distributed()
                )
            future = getattr(response, "upload_completion", response)
            global _pending
            _pending = _PendingSave(step, tmp, final, base, keep, future, process_group, started)
            return CheckpointInfo(step, str(tmp), 0, "", time.perf_counter() - started, committed=False)
        with _dcp_call():
            dcp.save(state, checkpoint_id=str(tmp), process_group=process_group, no_dist=not _distributed())
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(f"writing checkpoint step {step} to {tmp} failed: {e}") from e
    return _commit(step, tmp, final, base, keep, process_group, started)


def wait_pending() -> CheckpointInfo | None:
    """Finish and commit the async save in flight, if any (every rank calls); returns its info."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    try:
        pending.future.result()
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(f"async checkpoint of step {pending.step} to {pending.tmp} failed: {e}") from e
    return _commit(pending.step, pending.tmp, pending.final, pending.root, pending.keep,
                   pending.process_group, pending.started)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _commit(
    step: int, tmp: Path, final: Path, root: Path, keep: int, pg: Any, started: float
) -> CheckpointInfo:
    _barrier(pg)  # every rank's files are written
    files = _broadcast_from_0(_data_files(tmp) if _rank(pg) == 0 else None, pg)
    rank, world = _rank(pg), _world(pg)
    mine: dict[str, Any] = {}
    for name in files[rank::world]:  # hashing is split between the ranks
        try:
            mine[name] = {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        except OSError as e:
            mine[name] = {"error": str(e)}
    hashed: dict[str, Any] = {}
    for part in _all_gather(mine, pg):
        hashed.update(part)

    def write_manifest_and_rename() -> tuple[str, int]:
        bad = {n: e["error"] for n, e in hashed.items() if "error" in e}
        if bad:
            raise CheckpointError(f"cannot hash checkpoint files of step {step}: {bad}")
        raw = json.dumps(
            {"format": FORMAT_VERSION, "step": step, "world_size": world, "created": time.time(),
             "files": dict(sorted(hashed.items()))},
            indent=1,
        ).encode()
        _write_durable(tmp / MANIFEST, raw)
        _fsync_dir(tmp)
        trash = None
        if final.exists():  # re-saving a step: move the old one aside, then drop it after the commit
            trash = final.with_name(f"{final.name}.trash")
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(tmp, final)  # the commit point
        _fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        _prune(root, keep, step)
        return hashlib.sha256(raw).hexdigest(), sum(e["size"] for e in hashed.values())

    digest, size = _run_on_rank0(write_manifest_and_rename, pg)
    seconds = time.perf_counter() - started
    log.info("checkpoint step %d committed at %s (%d bytes, %.2fs)", step, final, size, seconds)
    return CheckpointInfo(step=step, path=str(final), bytes=size, manifest_digest=digest, seconds=seconds)


def _prune(root: Path, keep: int, just_saved: int) -> None:
    """Keep the newest `keep` committed steps (and always the one just saved); drop leftovers."""
    steps = list_checkpoints(root)
    doomed = [s for s in steps[: max(0, len(steps) - keep)] if s != just_saved]
    for s in doomed:
        path = _step_path(root, s)
        trash = path.with_name(f"{path.name}.trash")
        os.rename(path, trash)  # out of list_checkpoints' sight before the slow delete
        shutil.rmtree(trash, ignore_errors=True)
        log.info("pruned checkpoint step %d", s)
    for leftover in root.iterdir():
        if _LEFTOVER_DIR.match(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------
def load_checkpoint(
    path: str | os.PathLike[str],
    model_parts: list[nn.Module],
    optimizer: OptimizerArg,
    *,
    process_group: Any = None,
    verify: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Load one checkpoint into the (possibly differently parallelised) model parts and optimizer,
    restore this rank's RNG; returns (step, extra). Raises CheckpointCorrupt on every rank when
    the manifest does not verify (rank 0 checks)."""
    wait_pending()
    ckpt = Path(path)
    if verify:
        _run_on_rank0(lambda: verify_checkpoint(ckpt), process_group, error=CheckpointCorrupt)
    try:
        meta = json.loads((ckpt / META).read_text())
        step, extra = int(meta["step"]), dict(meta.get("extra") or {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupt(f"{ckpt}: {META} cannot be read: {e!r}") from e
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: checkpoint format {meta.get('format')} is not {FORMAT_VERSION}")

    pairs = optimizer_pairs(model_parts, optimizer)
    state: dict[str, Any] = {"model": model_state(model_parts)}
    optim_state = optimizer_state(pairs)
    if optim_state:
        state["optim"] = optim_state
    try:
        with _dcp_call():
            dcp.load(state, checkpoint_id=str(ckpt), process_group=process_group, no_dist=not _distributed())
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(f"loading {ckpt} failed (does it hold this model and optimizer?): {e}") from e
    load_model_state(model_parts, state["model"])
    if pairs:
        load_optimizer_state(pairs, state.get("optim", {}))

    rng_path = _rng_file(ckpt, _global_rank())
    if rng_path.is_file():
        set_rng_state(torch.load(rng_path, weights_only=True))
    else:
        log.info("%s has no RNG state for rank %d (saved by %s ranks): RNG not restored",
                 ckpt, _global_rank(), meta.get("world_size"))
    log.info("loaded checkpoint step %d from %s", step, ckpt)
    return step, extra


def load_latest_checkpoint(
    root: str | os.PathLike[str],
    model_parts: list[nn.Module],
    optimizer: OptimizerArg,
    *,
    allowed_steps: set[int] | None = None,
    process_group: Any = None,
) -> tuple[int, dict[str, Any]] | None:
    """Load the newest committed checkpoint (within allowed_steps) whose manifest verifies.

    Rank 0 verifies, newest first, skipping damaged ones with a warning, and broadcasts its choice
    so that all ranks load the same step. Returns (step, extra) or None when there is none.
    """
    wait_pending()
    base = Path(root)

    def choose() -> int | None:
        steps = [s for s in list_checkpoints(base) if allowed_steps is None or s in allowed_steps]
        for s in reversed(steps):
            try:
                verify_checkpoint(_step_path(base, s))
            except CheckpointCorrupt as e:
                log.warning("skipping damaged checkpoint step %d: %s", s, e)
                continue
            return s
        return None

    chosen = _run_on_rank0(choose, process_group)
    if chosen is None:
        log.info("no usable checkpoint under %s", base)
        return None
    return load_checkpoint(_step_path(base, chosen), model_parts, optimizer,
                           process_group=process_group, verify=False)
