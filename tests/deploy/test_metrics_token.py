"""deploy/metrics_token.py writes the /metrics scrape token of the compose stack: random, kept across
restarts, readable by owner and group only, never half-written."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from tests.deploy.tools import ROOT, run

SCRIPT = ROOT / "deploy" / "metrics_token.py"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_creates_a_random_token_0640_in_a_0750_folder(tmp_path: Path) -> None:
    first, second = tmp_path / "a" / "token", tmp_path / "b" / "token"
    for path in (first, second):
        result = run([sys.executable, str(SCRIPT), str(path)])
        assert result.returncode == 0, result.stderr
        assert f"created {path}" in result.stdout
        assert _mode(path) == 0o640 and _mode(path.parent) == 0o750
    token = first.read_text().strip()
    assert len(token) >= 40 and token != second.read_text().strip()
    assert [p.name for p in first.parent.iterdir()] == ["token"]  # no temporary file left


def test_keeps_an_existing_token_and_fixes_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("chosen-by-the-operator\n")
    path.chmod(0o666)
    result = run([sys.executable, str(SCRIPT), str(path)])
    assert result.returncode == 0 and "kept the existing" in result.stdout
    assert path.read_text() == "chosen-by-the-operator\n" and _mode(path) == 0o640


def test_replaces_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("\n")
    assert run([sys.executable, str(SCRIPT), str(path)]).returncode == 0
    assert path.read_text().strip()


def test_errors_are_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run([sys.executable, str(SCRIPT), str(blocker / "token")])
    assert result.returncode == 1
    assert result.stderr.startswith("metrics token: cannot write") and "Traceback" not in result.stderr
    usage = run([sys.executable, str(SCRIPT)])
    assert usage.returncode == 2 and "usage" in usage.stderr
