"""The service's state is private (0600 files, 0700 folders), and the bootstrap admin token is shown
only on a terminal."""

from __future__ import annotations

import os
from pathlib import Path

from service.cli.serve import bootstrap_notice
from service.settings import Settings
from service.statefiles import secure_home


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_bootstrap_token_is_printed_only_on_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "token"
    on_tty = bootstrap_notice("lat_secret", path, terminal=True)
    assert "lat_secret" in on_tty and str(path) in on_tty[0]
    in_log = bootstrap_notice("lat_secret", path, terminal=False)
    assert not any("lat_secret" in line for line in in_log)
    assert str(path) in in_log[0] and "0600" in in_log[0]


def test_a_fresh_home_is_created_private(tmp_path: Path) -> None:
    old = os.umask(0o022)  # an ordinary umask: the modes come from Lattice, not from luck
    try:
        settings = Settings(home=tmp_path / "deep" / "home")
        changed = secure_home(settings)
    finally:
        os.umask(old)
    home = settings.home
    assert changed == []
    assert _mode(home) == 0o700
    assert _mode(home / "checkpoints") == 0o700 and _mode(home / "data") == 0o700
    assert _mode(home / "lattice.db") == 0o600


def test_existing_state_is_tightened_and_outside_paths_left_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "checkpoints" / "job1").mkdir(parents=True)
    (home / "logs").mkdir()
    for name in ("lattice.db", "lattice.db-wal", "token", "server"):
        (home / name).write_text("x")
        os.chmod(home / name, 0o644)
    for folder in (home, home / "checkpoints", home / "logs"):
        os.chmod(folder, 0o755)
    shared = tmp_path / "shared-checkpoints"
    shared.mkdir()
    os.chmod(shared, 0o755)
    (home / "link").symlink_to(shared)

    settings = Settings(home=home, checkpoint_root=shared)
    changed = secure_home(settings)

    assert _mode(home) == 0o700 and _mode(home / "checkpoints") == 0o700 and _mode(home / "logs") == 0o700
    for name in ("lattice.db", "lattice.db-wal", "token", "server"):
        assert _mode(home / name) == 0o600, name
    assert _mode(shared) == 0o755  # the operator's folder (and a link to it) keep their modes
    assert set(changed) >= {home, home / "token", home / "lattice.db", home / "logs"}
    assert secure_home(settings) == []  # nothing left to tighten
