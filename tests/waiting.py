"""The one polling helper of the suite: wait until a condition holds, or fail naming what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.25) -> T:
    """`predicate()`'s first truthy value, polled every `interval_s`; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
