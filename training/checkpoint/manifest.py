"""Checkpoint files on disk: the manifest (sha256 + size of every file), its verification, durable
writes, listing and pruning of committed steps, and deliberate damage for fault tests.

No torch here: the controller verifies and lists checkpoints without loading them. The directory
layout and the commit protocol are described in training.checkpoint.checkpointer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
INTEGRITY = "integrity.json"  # {"verified": bool}: the step's integrity checks had passed
RNG_DIR = "rng"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_LEFTOVER_DIR = re.compile(r"^step-\d+\.(tmp|trash)$")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not match its manifest (or it has none); the message names the file."""


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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_files(ckpt: Path) -> list[str]:
    """Every file of a checkpoint except the manifest, as sorted POSIX paths relative to it."""
    return sorted(
        p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST
    )


def step_path(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank-{rank}.pt"


def list_checkpoints(root: str | os.PathLike[str]) -> list[int]:
    """Steps of the committed checkpoints under root, ascending (``.tmp``/``.trash`` are ignored)."""
    base = Path(root)
    if not base.is_dir():
        return []
    steps = [int(m.group(1)) for p in base.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps)


def vouched_steps(root: str | os.PathLike[str]) -> set[int]:
    """Committed checkpoints whose step's integrity checks had passed when they were saved
    (``INTEGRITY``, covered by the manifest): the record that survives when the ranks' own
    "verified" reports die with them before anyone reads them."""
    out = set()
    for step in list_checkpoints(root):
        try:
            doc = json.loads((step_path(Path(root), step) / INTEGRITY).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("verified") is True:
            out.add(step)
    return out


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
        if sha256_file(file) != entry.sha256:
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


def prune(root: Path, keep: int, just_saved: int) -> None:
    """Keep the newest `keep` committed steps (and always the one just saved); drop leftovers."""
    steps = list_checkpoints(root)
    doomed = [s for s in steps[: max(0, len(steps) - keep)] if s != just_saved]
    for s in doomed:
        path = step_path(root, s)
        trash = path.with_name(f"{path.name}.trash")
        os.rename(path, trash)  # out of list_checkpoints' sight before the slow delete
        shutil.rmtree(trash, ignore_errors=True)
        log.info("pruned checkpoint step %d", s)
    for leftover in root.iterdir():
        if _LEFTOVER_DIR.match(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)
