"""Checkpoints with torch.distributed.checkpoint (DCP): atomic commit, verified load, resharding.

Layout of a checkpoint root (a directory every rank sees: local disk for one host, a shared
filesystem for several)::

    <root>/
      step-40/              a committed checkpoint of step 40
        .metadata           DCP's global metadata: which file holds which chunk of which key
        __0_0.distcp ...    DCP data files, written by every rank: model and optimizer tensors
        rng/rank-0.pt ...   each rank's RNG states (torch CPU + CUDA, python `random`, numpy if present)
        meta.json           format, step, world size, time, and the caller's `extra` (data position)
        model.json          the ModelSpec (``describe``), layout.json the Layout it was saved from
        integrity.json      whether the step's integrity checks had passed (``describe``)
        manifest.json       sha256 + size of every other file; written last
      step-50.tmp/          a save in progress, or one that crashed: ignored by list and load
      step-30.trash/        being deleted (pruned or replaced): ignored

DCP keys are canonical FQNs, independent of the layout: ``model.<fqn>`` for parameters and
buffers, ``optim.state.<fqn>.<name>`` and ``optim.param_groups.<fqn>.<hyper>`` for the optimizer
(plain, ZeRO-1, FSDP2 and TP alike; see ``training.checkpoint.state``), so DCP reshards a
checkpoint to another DP size, ZeRO stage or TP degree by name.

Commit protocol of ``Checkpointer.save`` (all ranks of its process group call it):
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
training continues meanwhile. Step 3 runs in ``Checkpointer.wait_pending()``: the checkpoint is
committed (and only then visible to ``list_checkpoints``/loads) when the ranks next call
``wait_pending()``, ``save`` or one of the Checkpointer's loads, all of which wait for the write to
finish first. The train loop calls ``wait_pending()`` before it exits and ``close()`` when it ends
either way: a save still in flight when an attempt fails is abandoned with the Checkpointer (its
process group is gone with the attempt).

The Checkpointer owns that in-flight save and the writer's process group; one per trainer. Manifest,
verification, listing and pruning are in training.checkpoint.manifest (re-exported here).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
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

from training.checkpoint.groups import (
    all_gather,
    barrier,
    broadcast_from_0,
    global_rank,
    group_rank,
    group_size,
    is_distributed,
    run_on_rank0,
)
from training.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    META,
    RNG_DIR,
    CheckpointCorrupt,
    CheckpointError,
    Manifest,
    ManifestEntry,
    corrupt_checkpoint,
    data_files,
    fsync_dir,
    list_checkpoints,
    prune,
    rng_file,
    sha256_file,
    step_path,
    verify_checkpoint,
    write_durable,
)
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

__all__ = [
    "CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "Checkpointer", "Manifest",
    "ManifestEntry", "corrupt_checkpoint", "list_checkpoints", "load_checkpoint",
    "load_latest_checkpoint", "verify_checkpoint",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    bytes: int
    manifest_digest: str  # sha256 of manifest.json; "" while an async save is not committed
    seconds: float  # wall time of the save (for async: until the call returned, or until commit)
    committed: bool = True


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


@contextmanager
def _dcp_call() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield



# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------
class Checkpointer:
    """One trainer's checkpoint writer: at most one async save in flight, and the gloo group its
    background writer uses. Every rank of `process_group` (None = world) holds one and calls alike."""

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group
        self._pending: _PendingSave | None = None
        # ranks -> (the WORLD group it was made in, the writer's group)
        self._async_groups: dict[tuple[int, ...], tuple[Any, Any]] = {}

    def _async_group(self, pg: Any) -> Any:
        """A gloo group over pg's ranks for the background writer, so it never races the training
        collectives on pg (created once per rank set and process-group lifetime, by those ranks only)."""
        ranks = tuple(dist.get_process_group_ranks(pg or dist.group.WORLD))
        world = dist.group.WORLD
        cached = self._async_groups.get(ranks)
        if cached is None or cached[0] is not world:  # none yet, or torch.distributed was re-initialised
            group = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=True)
            cached = self._async_groups[ranks] = (world, group)
        return cached[1]

    def save(
        self,
        root: str,
        step: int,
        model_parts: list[nn.Module],
        optimizer: OptimizerArg,
        extra: dict[str, Any],
        *,
        keep: int = 3,
        async_save: bool = False,
        describe: dict[str, dict[str, Any]] | None = None,
    ) -> CheckpointInfo:
        """Save step ``step`` under ``root/step-<step>/`` (see the module docstring); every rank calls.

        ``extra`` must be JSON-serialisable (put the data position there: ``{"data": ds.state_dict()}``).
        ``optimizer`` is one optimizer per model part (or None). With async_save the result has
        ``committed=False``; ``wait_pending()`` returns the committed info. ``describe`` maps file
        names to JSON objects rank 0 writes beside the shards (the train loop: ``model.json``, the
        ModelSpec, and ``layout.json``, so a checkpoint can be read without its job).
        """
        process_group = self.process_group
        if keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        try:
            meta = json.dumps(
                {"format": FORMAT_VERSION, "step": step, "world_size": group_size(process_group),
                 "created": time.time(), "extra": extra},
                indent=1, sort_keys=True,
            ).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint extra must be JSON-serialisable: {e}") from e
        self.wait_pending()
        started = time.perf_counter()
        base = Path(root)
        tmp, final = base / f"step-{step}.tmp", step_path(base, step)

        def prepare() -> None:
            base.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / RNG_DIR).mkdir(parents=True)

        state = {"model": model_state(model_parts)}  # before touching the disk: bad arguments raise here
        optim_state = optimizer_state(optimizer_pairs(model_parts, optimizer))
        if optim_state:
            state["optim"] = optim_state
        run_on_rank0(prepare, process_group)
        write_durable(rng_file(tmp, global_rank()), _torch_bytes(rng_state()))
        if group_rank(process_group) == 0:
            write_durable(tmp / META, meta)
            for name, content in (describe or {}).items():
                write_durable(tmp / name, json.dumps(content, indent=1, sort_keys=True).encode())
        try:
            if async_save:
                group = self._async_group(process_group) if is_distributed() else None
                with _dcp_call():
                    response = dcp.async_save(
                        state, checkpoint_id=str(tmp), process_group=group, no_dist=not is_distributed()
                    )
                future = getattr(response, "upload_completion", response)
                self._pending = _PendingSave(step, tmp, final, base, keep, future, process_group, started)
                return CheckpointInfo(step, str(tmp), 0, "", time.perf_counter() - started, committed=False)
            with _dcp_call():
                dcp.save(state, checkpoint_id=str(tmp), process_group=process_group,
                         no_dist=not is_distributed())
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise CheckpointError(f"writing checkpoint step {step} to {tmp} failed: {e}") from e
        return _commit(step, tmp, final, base, keep, process_group, started)

    def wait_pending(self) -> CheckpointInfo | None:
        """Finish and commit the async save in flight, if any (every rank calls); returns its info."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise CheckpointError(
                f"async checkpoint of step {pending.step} to {pending.tmp} failed: {e}"
            ) from e
        return _commit(pending.step, pending.tmp, pending.final, pending.root, pending.keep,
                       pending.process_group, pending.started)

    def load_latest(
        self,
        root: str | os.PathLike[str],
        model_parts: list[nn.Module],
        optimizer: OptimizerArg,
        *,
        allowed_steps: set[int] | None = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """`load_latest_checkpoint` over this Checkpointer's group, after the save in flight commits."""
        self.wait_pending()
        return load_latest_checkpoint(root, model_parts, optimizer, allowed_steps=allowed_steps,
                                      process_group=self.process_group)

    def close(self) -> None:
        """Drop the save in flight without committing it: called when the attempt ends (after
        `wait_pending()` on success; on a failure its process group may be gone, so it cannot commit
        and its `.tmp` directory is cleared by the next save of that step or pruned)."""
        if self._pending is not None:
            log.warning("abandoning the uncommitted async checkpoint of step %d", self._pending.step)
        self._pending = None
        self._async_groups.clear()


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _commit(
    step: int, tmp: Path, final: Path, root: Path, keep: int, pg: Any, started: float
) -> CheckpointInfo:
    barrier(pg)  # every rank's files are written
    files = broadcast_from_0(data_files(tmp) if group_rank(pg) == 0 else None, pg)
    rank, world = group_rank(pg), group_size(pg)
    mine: dict[str, Any] = {}
    for name in files[rank::world]:  # hashing is split between the ranks
        try:
            mine[name] = {"size": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        except OSError as e:
            mine[name] = {"error": str(e)}
    hashed: dict[str, Any] = {}
    for part in all_gather(mine, pg):
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
        write_durable(tmp / MANIFEST, raw)
        fsync_dir(tmp)
        trash = None
        if final.exists():  # re-saving a step: move the old one aside, then drop it after the commit
            trash = final.with_name(f"{final.name}.trash")
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(tmp, final)  # the commit point
        fsync_dir(root)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        prune(root, keep, step)
        return hashlib.sha256(raw).hexdigest(), sum(e["size"] for e in hashed.values())

    digest, size = run_on_rank0(write_manifest_and_rename, pg)
    seconds = time.perf_counter() - started
    log.info("checkpoint step %d committed at %s (%d bytes, %.2fs)", step, final, size, seconds)
    return CheckpointInfo(step=step, path=str(final), bytes=size, manifest_digest=digest, seconds=seconds)


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
    ckpt = Path(path)
    if verify:
        run_on_rank0(lambda: verify_checkpoint(ckpt), process_group, error=CheckpointCorrupt)
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
            dcp.load(state, checkpoint_id=str(ckpt), process_group=process_group,
                     no_dist=not is_distributed())
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise CheckpointError(f"loading {ckpt} failed (does it hold this model and optimizer?): {e}") from e
    load_model_state(model_parts, state["model"])
    if pairs:
        load_optimizer_state(pairs, state.get("optim", {}))

    rng_path = rng_file(ckpt, global_rank())
    if rng_path.is_file():
        set_rng_state(torch.load(rng_path, weights_only=True))
    else:
        log.info("%s has no RNG state for rank %d (saved by %s ranks): RNG not restored",
                 ckpt, global_rank(), meta.get("world_size"))
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
    base = Path(root)

    def choose() -> int | None:
        steps = [s for s in list_checkpoints(base) if allowed_steps is None or s in allowed_steps]
        for s in reversed(steps):
            try:
                verify_checkpoint(step_path(base, s))
            except CheckpointCorrupt as e:
                log.warning("skipping damaged checkpoint step %d: %s", s, e)
                continue
            return s
        return None

    chosen = run_on_rank0(choose, process_group)
    if chosen is None:
        log.info("no usable checkpoint under %s", base)
        return None
    return load_checkpoint(step_path(base, chosen), model_parts, optimizer,
                           process_group=process_group, verify=False)
