"""System tools the deploy tests use: a missing one fails the test under CI and skips it elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_binary(name: str, debian_package: str) -> str:
    """Path of `name`; pytest.fail under CI=true when it is missing, pytest.skip otherwise."""
    path = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/bin") / name, ROOT / ".venv" / "bin" / name) if p.exists()), None
    )
    if path is None:
        message = f"`{name}` is not installed (Debian package `{debian_package}`; `make system-deps`)"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
