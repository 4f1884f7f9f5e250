"""Training data lives under one folder, `LATTICE_DATA_ROOT`: a job's `data.path` is resolved inside
it at submit, and the ranks open only the resolved absolute path the service hands them.

Containment is decided on the real path (`os.path.realpath`: `..` and symbolic links resolved), so
neither `../x` nor a link can reach outside. A path outside the root gets the same answer whether
or not it exists (no existence oracle), and no message carries an OS error text or file bytes.
The service's own state (token file, SQLite database, checkpoints) must never be readable as data,
so the root may not contain it (`check_data_root`, at startup).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from service.errors import InvalidRequest
from service.settings import Settings
from training.data.confined import ConfinedPathError, inside, open_confined
from training.data.token_files import SHARD_SUFFIX, TOKEN_DTYPES, windows_per_shard

FIELD = "data.path"


class DataRootError(RuntimeError):
    """The configured data root would expose the service's own state; the service refuses to start."""


def _state_paths(settings: Settings) -> list[tuple[str, Path]]:
    paths = [("LATTICE_TOKEN_FILE", settings.token_path), ("the server file", settings.server_file)]
    if settings.checkpoint_root is not None:
        paths.append(("LATTICE_CHECKPOINT_ROOT", settings.checkpoint_root))
    if settings.is_sqlite:
        db_file = settings.db_url.split("///", 1)[-1]
        if db_file and db_file != ":memory:":
            paths.append(("the SQLite database", Path(db_file)))
    return paths


def check_data_root(settings: Settings) -> Path:
    """Create the data root (0700) if missing and refuse one that would expose the service's state:
    the root may not be the home, contain the home, or contain the token file, the database or the
    checkpoints. Returns the real path of the root."""
    root = settings.data_root_path
    settings.home.mkdir(mode=0o700, parents=True, exist_ok=True)  # state folders are 0700
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    real_root = os.path.realpath(root)
    home = os.path.realpath(settings.home)
    if inside(home, real_root):
        raise DataRootError(
            f"LATTICE_DATA_ROOT ({root}) must not be LATTICE_HOME ({settings.home}) or a folder above it: "
            "jobs could read the service's token and database; use a separate folder (default <home>/data)"
        )
    for name, path in _state_paths(settings):
        if inside(os.path.realpath(path), real_root):
            raise DataRootError(
                f"LATTICE_DATA_ROOT ({root}) contains {name} ({path}): jobs could read it as training data; "
                "move one of them"
            )
    return Path(real_root)


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(f"{FIELD}: {message}", errors=[{"field": FIELD, "message": message}])


def _readable_file(path: str, shown: str, root: str) -> int:
    """The size of a regular, readable file inside the root, checked as opened (a FIFO does not block
    it, a link swapped in meanwhile is seen: training.data.confined); errors never carry OS text."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise _refuse(f"{shown!r} does not exist in the data root") from e
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(f"{shown!r} is not a regular file")
    try:
        with open_confined(path, root, FIELD) as f:
            return os.fstat(f.fileno()).st_size
    except ConfinedPathError as e:
        raise _refuse(f"{shown!r} is not a regular file inside the data root") from e
    except OSError as e:
        raise _refuse(f"{shown!r} cannot be read by the service") from e


def _files(real: str, shown: str, root: str) -> list[tuple[str, str]]:
    """(real path, name to show) of the token file, or of a folder's shards, all inside the root."""
    if not os.path.isdir(real):
        return [(real, shown)]
    files = []
    for name in sorted(os.listdir(real)):
        if not name.endswith(SHARD_SUFFIX):
            continue
        shard = os.path.realpath(os.path.join(real, name))
        if not inside(shard, root):
            raise _refuse(f"shard {name!r} of {shown!r} must be inside the data root (it links out)")
        files.append((shard, f"{shown.rstrip('/')}/{name}"))
    if not files:
        raise _refuse(f"{shown!r} is a folder without {SHARD_SUFFIX} shards")
    return files


def resolve_data_path(settings: Settings, path: str, *, seq_len: int, dtype: str = "uint16") -> str:
    """The real absolute path of `path` (relative to the data root, or absolute inside it), checked
    to hold at least one sample of seq_len + 1 `dtype` tokens. Raises InvalidRequest naming data.path."""
    root = os.path.realpath(settings.data_root_path)
    candidate = path if os.path.isabs(path) else os.path.join(root, path)
    real = os.path.realpath(candidate)
    if not inside(real, root):
        raise _refuse(
            f"{path!r} must be inside the data root (a path relative to it, or an absolute path under it; "
            "no '..' or links out of it)"
        )
    width = TOKEN_DTYPES.get(dtype, 2)
    counts = []
    for file, shown in _files(real, path, root):
        size = _readable_file(file, shown, root)
        if size % width:
            raise _refuse(
                f"{shown!r} has {size} bytes, not a whole number of {dtype} tokens ({width} bytes each)"
            )
        counts.append(size // width)
    if sum(windows_per_shard(counts, seq_len)) < 1:
        raise _refuse(
            f"{path!r} holds {sum(counts)} tokens; at least one sample of seq_len + 1 = {seq_len + 1} tokens "
            "(in one file) is needed"
        )
    return real
