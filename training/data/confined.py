"""Open a file a job names (its token files, its held-out data, its `model.init_from` weights) so
that what is read is what the service allowed: a regular file inside the data root.

The service resolves those paths to real paths inside `LATTICE_DATA_ROOT` at submit
(service.api.data_root), and the data root never holds the service's own state. A job may wait in
the queue for hours after that; a tenant who can write in the data root could meanwhile replace the
file, or a folder above it, by a link to the service's token file, and `open()` would follow it.
So the check is repeated on the file actually opened, not on its name: the kernel's name for the
open descriptor (`/proc/self/fd/N` on Linux, `F_GETPATH` on macOS) must lie inside the root. There is
no window between the check and the read. `O_NONBLOCK` keeps a FIFO swapped in from blocking the
rank (it would look like a hang, blamed on the node); anything but a regular file is refused.

Torch-free: the service uses it too.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import BinaryIO


class ConfinedPathError(ValueError):
    """A file that is not a regular file inside the root; the message names the field."""


def inside(path: str, root: str) -> bool:
    """`path` is `root` or below it (both real paths)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def opened_path(fd: int, fallback: str) -> str:
    """The kernel's real path of an open descriptor (links resolved when it was opened)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
    if sys.platform == "darwin":  # pragma: no cover - exercised on macOS only
        import fcntl

        name = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))  # type: ignore[attr-defined]
        return os.fsdecode(name.split(b"\0", 1)[0])
    return os.path.realpath(fallback)  # pragma: no cover - no way to ask the kernel here


def by_descriptor(fd: int) -> str | None:
    """A path that reaches an open descriptor's file itself, whatever its name now leads to (Linux's
    /proc/self/fd), or None where there is none."""
    path = f"/proc/self/fd/{fd}"
    return path if os.path.exists(path) else None


def open_confined(path: str | os.PathLike[str], root: str | None, field: str) -> BinaryIO:
    """`path` opened for reading, refused (ConfinedPathError naming `field`) unless it is a regular
    file and, with `root` (a real path), the file opened lies inside it. OSError when it cannot be
    opened at all (the caller words it: no OS error text reaches a tenant)."""
    path = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfinedPathError(f"{field} {path!r} is not a regular file")
        if root is not None and not inside(opened_path(fd, path), root):
            raise ConfinedPathError(
                f"{field} {path!r} now leads outside the data root (a link replaced it, or a folder "
                "above it, after the job was submitted); put the data itself in the data root")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
