"""The embedded Ray cluster's nodes are processes on this machine: a worker process's environment
tells whose it is (a job-unique environment variable), without asking Ray."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def processes_with_env(marker: str) -> set[int]:
    """Live processes on this machine whose environment holds `marker` (NAME=value); zombies excluded."""
    out = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    out.add(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return out


def until(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether `check` came true within `timeout_s` (polled)."""
    deadline = time.monotonic() + timeout_s
    while not (ok := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return ok
