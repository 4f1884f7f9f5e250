"""Each rank's output, per attempt, in a file the service can read: where the files are, how a rank
writes them, and how they are read back.

Layout (under the job's folder, `<checkpoint_root>/<job_id>`, on the shared volume in production):

    logs/attempt-<k>/rank-<r>.log      the newest part of rank r's output in the k-th start of the ranks
    logs/attempt-<k>/rank-<r>.log.1    older parts (rotated at `max_bytes`, `backups` of them kept)

An attempt is one start of the job's ranks (numbered from 1 over the job's life, across controllers:
the worker group takes the next free number in the folder when it launches the ranks). A rank writes
its file from its own process (`capture_rank_output`): every write to `sys.stdout`/`sys.stderr` while
the attempt runs (teed: Ray's worker files still get them), every logging record at INFO or above,
with the traceback when the training function raises, and what native code writes to the process's
standard error (file descriptor 2: a C++ `terminate called after throwing ...`, a gloo or c10d error,
the stacks faulthandler prints on a fatal signal), which is often the only trace of a rank that
aborted. Files are flushed at every write, so the service reads them while the job runs, after it
ends, and after a restart. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import faulthandler
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TextIO

log = logging.getLogger(__name__)

LOGS_SUBDIR = "logs"
DEFAULT_MAX_BYTES = 10 * 2**20  # per file; a rank keeps at most (1 + backups) files per attempt
DEFAULT_BACKUPS = 2
RECORD_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_ATTEMPT_DIR = re.compile(r"^attempt-([1-9][0-9]{0,8})$")
_RANK_FILE = re.compile(r"^rank-(0|[1-9][0-9]{0,8})\.log$")
_MAX_ROTATIONS_READ = 100  # rotations a reader looks for (more than any setting keeps)
_READ_BLOCK = 64 * 1024


# ---- where the files are ------------------------------------------------------------------------------
def job_logs_dir(job_dir: str | os.PathLike[str]) -> Path:
    """The logs folder of a job whose folder (its checkpoint directory) is `job_dir`."""
    return Path(job_dir) / LOGS_SUBDIR


def attempt_dir(logs_dir: Path, attempt: int) -> Path:
    if not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an integer >= 1, got {attempt!r}")
    return logs_dir / f"attempt-{attempt}"


def rank_log_path(logs_dir: Path, attempt: int, rank: int) -> Path:
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
    return attempt_dir(logs_dir, attempt) / f"rank-{rank}.log"


def log_index(logs_dir: Path) -> dict[int, list[int]]:
    """{attempt: [ranks with a log]} for every attempt folder, ascending."""
    out: dict[int, list[int]] = {}
    try:
        entries = list(logs_dir.iterdir())
    except OSError:
        return out
    for entry in entries:
        m = _ATTEMPT_DIR.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            ranks = sorted(int(r.group(1)) for f in entry.iterdir() if (r := _RANK_FILE.match(f.name)))
        except OSError:
            continue
        out[int(m.group(1))] = ranks
    return dict(sorted(out.items()))


def new_attempt(logs_dir: Path) -> int:
    """Create the next attempt folder (one more than the highest there) and return its number."""
    while True:
        attempt = max(log_index(logs_dir), default=0) + 1
        try:
            attempt_dir(logs_dir, attempt).mkdir(parents=True, exist_ok=False)
            return attempt
        except FileExistsError:
            continue  # taken meanwhile (a controller that just replaced another): the next one


@dataclass(frozen=True)
class LogTarget:
    """Where the ranks of one attempt write (handed to every rank actor at start)."""

    logs_dir: str
    attempt: int
    max_bytes: int = DEFAULT_MAX_BYTES
    backups: int = DEFAULT_BACKUPS

    def path(self, rank: int) -> Path:
        return rank_log_path(Path(self.logs_dir), self.attempt, rank)


# ---- writing (in the rank's process) --------------------------------------------------------------------
class RotatingWriter:
    """Appends text to a file, flushed at every write; past `max_bytes` the file becomes `.1` (`.1`
    becomes `.2`, ...), keeping `backups` old ones. Thread-safe."""

    def __init__(
        self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, backups: int = DEFAULT_BACKUPS
    ) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"max_bytes must be >= 1 and backups >= 0, got {max_bytes}, {backups}")
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self._lock = threading.RLock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] | None = open(path, "ab")  # closed by close()
        self.on_reopen: Callable[[int], None] | None = None  # called with the new file's descriptor

    def fileno(self) -> int:
        with self._lock:
            if self._file is None:
                raise ValueError(f"{self.path} is closed")
            return self._file.fileno()

    def write(self, text: str) -> None:
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if self._file is None or not data:
                return
            size = os.fstat(self._file.fileno()).st_size  # fd 2 appends to the same file too
            if size > 0 and size + len(data) > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._file.flush()

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab")
        if self.on_reopen is not None:
            self.on_reopen(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


class _Tee:
    """A stand-in for sys.stdout/sys.stderr: writes go to the original stream and to the log."""

    def __init__(self, original: TextIO, writer: RotatingWriter) -> None:
        self._original, self._writer = original, writer

    def write(self, text: str) -> int:
        self._writer.write(text)
        try:
            return self._original.write(text)
        except (OSError, ValueError):  # the original stream is closed: the log still has it
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._original.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._original, name)


class _WriterHandler(logging.Handler):
    def __init__(self, writer: RotatingWriter) -> None:
        super().__init__(logging.INFO)
        self._writer = writer
        self.setFormatter(logging.Formatter(RECORD_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._writer.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


@contextmanager
def capture_rank_output(target: LogTarget | None, rank: int) -> Iterator[RotatingWriter | None]:
    """While inside: this process's stdout/stderr writes and logging records (INFO and above) also
    go to rank `rank`'s file of `target`'s attempt, and so does everything written to fd 2. No target
    (a bare worker group): nothing is kept. A file that cannot be opened is logged and skipped: the
    rank trains without it."""
    if target is None:
        yield None
        return
    try:
        writer = RotatingWriter(target.path(rank), target.max_bytes, target.backups)
    except (OSError, ValueError) as e:
        log.warning("rank %d: cannot write its log under %s: %s", rank, target.logs_dir, e)
        yield None
        return
    root = logging.getLogger()
    handler, old_level = _WriterHandler(writer), root.level
    root.addHandler(handler)
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    old_out, old_err = sys.stdout, sys.stderr
    try:
        with _native_stderr_to(writer, old_err) as python_err:
            sys.stdout, sys.stderr = _Tee(old_out, writer), _Tee(python_err, writer)  # type: ignore[assignment]
            try:
                yield writer
            finally:
                sys.stdout, sys.stderr = old_out, old_err
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        writer.close()


_native_lock = threading.Lock()  # one redirection of fd 2 at a time in a process


@contextmanager
def _native_stderr_to(writer: RotatingWriter, python_err: TextIO) -> Iterator[TextIO]:
    """While inside, file descriptor 2 is the writer's file (and follows it when it rotates), so a
    native abort's message lands in the rank's log before the process dies; faulthandler writes
    every thread's stack there on a fatal signal (SIGSEGV, SIGABRT, SIGBUS, ...). Yields the stream
    Python's own stderr writes should go to besides the log: the fd 2 the process had (Ray's worker
    file), so they are neither lost there nor written twice here. Only one rank at a time in a
    process redirects: a second one (never in a rank actor) keeps the process's fd 2."""
    if not _native_lock.acquire(blocking=False):
        yield python_err
        return
    was_enabled = faulthandler.is_enabled()
    try:
        saved = os.dup(2)
    except OSError as e:  # no fd 2 at all: nothing to redirect
        log.warning("cannot keep native stderr in %s: %s", writer.path, e)
        _native_lock.release()
        yield python_err
        return
    original = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False), encoding="utf-8",
                                errors="backslashreplace", write_through=True)
    try:
        _flush(python_err)
        os.dup2(writer.fileno(), 2)
        writer.on_reopen = lambda fd: os.dup2(fd, 2)
        faulthandler.enable(file=2, all_threads=True)
        yield original
    finally:
        writer.on_reopen = None
        faulthandler.disable()
        _flush(python_err)
        os.dup2(saved, 2)
        original.close()
        os.close(saved)
        _native_lock.release()
        if was_enabled and sys.__stderr__ is not None:  # as Ray's workers had it: to the process's stderr
            faulthandler.enable(file=sys.__stderr__, all_threads=True)


def _flush(stream: TextIO) -> None:
    try:
        stream.flush()
    except (OSError, ValueError):
        pass


# ---- reading (in the service) ------------------------------------------------------------------------
def log_parts(path: Path) -> list[Path]:
    """The files of one rank's log, oldest first (`.N` ... `.1`, then the file itself)."""
    rotated = (path.with_name(f"{path.name}.{i}") for i in range(_MAX_ROTATIONS_READ, 0, -1))
    parts = [p for p in rotated if p.is_file()]
    return [*parts, path] if path.is_file() else parts


def log_size(path: Path) -> int:
    total = 0
    for p in log_parts(path):
        try:
            total += p.stat().st_size
        except OSError:
            continue
    return total


def iter_log(path: Path, block: int = _READ_BLOCK) -> Iterator[bytes]:
    """The whole log, oldest part first, in blocks."""
    for part in log_parts(path):
        try:
            with open(part, "rb") as f:
                while chunk := f.read(block):
                    yield chunk
        except OSError:
            continue  # rotated away while we read it


def _last_lines(part: Path, n: int, end: int | None = None) -> list[bytes]:
    """Up to the last `n` lines of one file's first `end` bytes (each with its newline, if it had one)."""
    with open(part, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        data, pos = b"", size if end is None else min(end, size)
        while pos > 0 and data.count(b"\n") <= n:
            step = min(_READ_BLOCK, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    return data.splitlines(keepends=True)[-n:] if n > 0 else []


def tail_log(path: Path, n: int, end: int | None = None) -> bytes:
    """The last `n` lines of the log, across its rotated parts (of the newest part, only its first
    `end` bytes: what a follower opened at `end` has not read yet comes later, not twice)."""
    lines: list[bytes] = []
    if n <= 0:
        return b""
    for part in reversed(log_parts(path)):
        try:
            got = _last_lines(part, n - len(lines), end if part == path else None)
        except OSError:
            continue
        if lines and got and not got[-1].endswith(b"\n"):
            got[-1] += b"\n"
        lines = got + lines
        if len(lines) >= n:
            break
    return b"".join(lines[-n:])


class LogFollower:
    """Reads what is appended to one log file, across rotations (`tail -F`): `read_new()` returns
    the bytes written since the last call, starting at byte `start` of the file (nothing while the
    file does not exist yet)."""

    def __init__(self, path: Path, start: int = 0) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._inode: int | None = None
        self._start = start

    def read_new(self, limit: int = 4 * 2**20) -> bytes:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # closed by close(), or on rotation
            except OSError:
                return b""
            self._inode = os.fstat(self._file.fileno()).st_ino
            self._file.seek(self._start)
        data = self._file.read(limit)
        if data:
            return data
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            return b""
        if inode != self._inode:  # rotated: the old file is drained, go on with the new one
            self._file.close()
            self._file, self._start = None, 0
            return self.read_new(limit)
        return b""

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"
