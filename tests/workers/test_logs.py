"""A rank's log file (workers.logs): what the capture keeps, rotation, attempt folders, reading back."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest

from workers.logs import (
    LogFollower,
    LogTarget,
    RotatingWriter,
    capture_rank_output,
    iter_log,
    job_logs_dir,
    log_index,
    log_parts,
    new_attempt,
    rank_log_path,
    tail_log,
)


def test_capture_keeps_stdout_stderr_and_logging_of_the_training_thread(tmp_path: Path) -> None:
    target = LogTarget(str(job_logs_dir(tmp_path)), attempt=new_attempt(job_logs_dir(tmp_path)))
    failed: list[BaseException] = []
    streams = (sys.stdout, sys.stderr)

    def train() -> None:
        with capture_rank_output(target, rank=3):
            print("marker-stdout 41")
            sys.stderr.write("marker-stderr 42\n")
            logging.getLogger("training.somewhere").info("marker-logging %d", 43)
            logging.getLogger("training.somewhere").debug("not at debug")
            try:
                raise ValueError("boom in step 7")
            except ValueError as e:
                logging.getLogger("workers.rank").warning("rank 3 failed: %s", e, exc_info=e)
                failed.append(e)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    text = target.path(3).read_text()
    assert target.path(3) == tmp_path / "logs" / "attempt-1" / "rank-3.log"
    for marker in ("marker-stdout 41\n", "marker-stderr 42\n", "INFO training.somewhere: marker-logging 43"):
        assert marker in text
    assert "not at debug" not in text
    assert "Traceback (most recent call last)" in text and "ValueError: boom in step 7" in text
    # Everything is restored afterwards: later output does not reach the file.
    print("after the attempt")
    logging.getLogger("training.somewhere").warning("after the attempt")
    assert "after the attempt" not in target.path(3).read_text()
    assert (sys.stdout, sys.stderr) == streams and failed


def test_no_target_keeps_nothing_and_an_unwritable_folder_does_not_stop_the_rank(tmp_path: Path) -> None:
    with capture_rank_output(None, rank=0) as writer:
        assert writer is None
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with capture_rank_output(LogTarget(str(blocker / "logs"), 1), rank=0) as writer:
        assert writer is None
        print("still runs")


def test_rotation_caps_the_size_and_keeps_the_newest_output(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    writer = RotatingWriter(path, max_bytes=1000, backups=2)
    lines = [f"line {i:05d} " + "x" * 40 + "\n" for i in range(200)]  # 52 bytes each, ~10 KB in all
    for line in lines:
        writer.write(line)
    writer.close()
    parts = log_parts(path)
    assert [p.name for p in parts] == ["rank-0.log.2", "rank-0.log.1", "rank-0.log"]
    assert all(p.stat().st_size <= 1000 for p in parts)
    kept = b"".join(iter_log(path)).decode()
    assert kept.endswith(lines[-1]) and lines[0] not in kept  # oldest dropped, newest kept, in order
    assert kept == "".join(lines[-kept.count("\n"):])
    assert tail_log(path, 3).decode() == "".join(lines[-3:])
    tail_across = tail_log(path, 25).decode()  # more lines than the newest part holds
    assert tail_across == "".join(lines[-25:])


def test_attempt_folders_are_numbered_and_indexed(tmp_path: Path) -> None:
    logs = job_logs_dir(tmp_path)
    assert log_index(logs) == {}
    assert [new_attempt(logs) for _ in range(3)] == [1, 2, 3]
    for attempt, ranks in ((1, (0, 1)), (3, (1,))):
        for r in ranks:
            rank_log_path(logs, attempt, r).write_text("x\n")
    (logs / "attempt-3" / "notes.txt").write_text("ignored")
    (logs / "attempt-x").mkdir()
    assert log_index(logs) == {1: [0, 1], 2: [], 3: [1]}
    with pytest.raises(ValueError, match="attempt must be an integer >= 1"):
        rank_log_path(logs, 0, 0)
    with pytest.raises(ValueError, match="rank must be an integer >= 0"):
        rank_log_path(logs, 1, -1)


def test_follower_reads_appends_across_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.log"
    follower = LogFollower(path)
    assert follower.read_new() == b""  # not there yet
    writer = RotatingWriter(path, max_bytes=30, backups=1)
    writer.write("first line 0123456789\n")
    assert follower.read_new() == b"first line 0123456789\n"
    writer.write("second line 012345\n")  # rotates: the first line moves to .1
    writer.write("third\n")
    got = follower.read_new() + follower.read_new()
    assert got == b"second line 012345\nthird\n"
    writer.close()
    follower.close()
    assert LogFollower(path, start=len("second line 012345\n")).read_new() == b"third\n"


_CRASH = """
import ctypes, sys, threading
from pathlib import Path
from workers.logs import LogTarget, capture_rank_output, job_logs_dir, new_attempt
root = job_logs_dir(Path(sys.argv[1]))
target = LogTarget(str(root), attempt=new_attempt(root))
def train():
    print("step 1", flush=True)
    ctypes.string_at(0)  # a read of address 0 in native code, as a crash in gloo or a kernel would be
with capture_rank_output(target, rank=2):
    t = threading.Thread(target=train, name="lattice-rank-2")
    t.start()
    t.join()
"""


def test_a_rank_killed_by_a_fatal_signal_leaves_every_threads_stack_in_its_log(tmp_path: Path) -> None:
    """A native crash (SIGSEGV) ends the process before Python logs anything: faulthandler writes the
    stacks to the rank's file first, so the attempt's log says where it died."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == -11, proc.stderr[-2000:]
    text = rank_log_path(job_logs_dir(tmp_path), 1, 2).read_text()
    assert "step 1" in text and "Fatal Python error: Segmentation fault" in text
    assert "in train" in text  # the crashing thread's frame, named


_ABORT = """
import ctypes, os, sys, threading
from pathlib import Path
from workers.logs import LogTarget, capture_rank_output, job_logs_dir, new_attempt
root = job_logs_dir(Path(sys.argv[1]))
libc = ctypes.CDLL(None)
with capture_rank_output(LogTarget(str(root), attempt=new_attempt(root), max_bytes=256), rank=0):
    os.write(2, b"native before rotation\\n")
    print("x" * 250, flush=True)  # past max_bytes with what fd 2 wrote: the file rotates, fd 2 follows it
    libc.dprintf(2, b"native after rotation\\n")
os.write(2, b"native after the attempt\\n")
def train():
    print("step 5", flush=True)
    sys.stderr.write("python stderr 77\\n")
    libc.dprintf(2, b"terminate called after throwing an instance of 'gloo::IoException'\\n")
    libc.abort()  # as std::terminate does, from native code
with capture_rank_output(LogTarget(str(root), attempt=new_attempt(root)), rank=6):
    t = threading.Thread(target=train, name="lattice-rank-6")
    t.start()
    t.join()
"""


def test_what_native_code_writes_to_stderr_before_an_abort_is_in_the_ranks_log(tmp_path: Path) -> None:
    """A C++ `terminate called ...` goes to file descriptor 2, not to sys.stderr: while a rank trains,
    fd 2 is its log file (following rotation), so the message that says why it aborted is kept with
    faulthandler's stacks; Python's own stderr still reaches the process's stderr, and only once the log."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _ABORT, str(tmp_path)], capture_output=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == -6, proc.stderr[-2000:]
    logs = job_logs_dir(tmp_path)
    first = rank_log_path(logs, 1, 0)
    assert "native before rotation" in first.with_name(first.name + ".1").read_text()
    assert "native after rotation" in first.read_text()
    assert b"native after the attempt" in proc.stderr  # fd 2 is the process's again after the attempt
    assert b"native" not in proc.stderr.replace(b"native after the attempt", b"")
    text = "".join(p.read_text() for p in log_parts(rank_log_path(logs, 2, 6)))
    assert "step 5" in text and "gloo::IoException" in text
    assert text.count("python stderr 77") == 1 and b"python stderr 77" in proc.stderr
    assert "Fatal Python error: Aborted" in text and "in train" in text
