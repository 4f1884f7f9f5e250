"""The service's state under `LATTICE_HOME` is private to its user: folders 0700, files 0600.

`lattice serve` also sets the process umask to 0o077, so whatever it (and the embedded Ray cluster
it starts) creates later is private too. At every start `secure_home` creates the home, the SQLite
file and the default checkpoint and data folders with those modes and tightens existing ones (an
older Lattice left them 0644 / 0755). Folders outside the home (a shared checkpoint store, a data
root the operator set) are created private when Lattice creates them, but never chmod-ed: the
operator owns their modes. A SQLite database is Lattice's own wherever it lies: always tightened.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from service.settings import Settings
from service.store.db import is_sqlite, sqlite_path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
_SQLITE_SUFFIXES = ("", "-wal", "-shm", "-journal")


def tighten(path: Path) -> bool:
    """Remove group and other permissions from `path` (not following a symlink); True if it changed."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return False
    try:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
    except OSError as e:
        log.warning("cannot make %s private: %s", path, e.strerror or e)
        return False
    return True


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with mode 0700; tighten it if it exists."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    tighten(path)


def write_private(path: Path, text: str) -> None:
    """Write a file that is 0600 from its first byte (never readable by others, not even briefly)."""
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, FILE_MODE)


def _under(path: Path, home: Path) -> bool:
    return path.resolve().is_relative_to(home.resolve())


def _data_root(settings: Settings) -> Path:
    root = getattr(settings, "data_root", None)  # a field of the data-root work; default below
    return Path(root) if root is not None else settings.home / "data"


def secure_home(settings: Settings) -> list[Path]:
    """Create the home and its state private, and tighten what exists; returns the paths changed."""
    home = settings.home
    changed: list[Path] = []
    home.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    if tighten(home):
        changed.append(home)
    for entry in sorted(home.iterdir()):  # one level: a 0700 home already guards what is deeper
        if tighten(entry):
            changed.append(entry)
    assert settings.checkpoint_root is not None
    for folder in (settings.checkpoint_root, _data_root(settings)):
        if not folder.exists():
            folder.mkdir(mode=DIR_MODE, parents=True)
        elif _under(folder, home) and tighten(folder):
            changed.append(folder)
    if is_sqlite(settings.db_url):
        db = sqlite_path(settings.db_url)
        if db is not None:
            db.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            # SQLite creates its -wal and -shm files with the database file's mode: create it 0600.
            os.close(os.open(db, os.O_WRONLY | os.O_CREAT, FILE_MODE))
            for suffix in _SQLITE_SUFFIXES:
                extra = db.with_name(db.name + suffix)
                if tighten(extra):
                    changed.append(extra)
    if changed:
        log.info("made private (0600 files, 0700 folders): %s", ", ".join(str(p) for p in changed))
    return changed
