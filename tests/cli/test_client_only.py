"""The client-only install: the base dependencies of pyproject.toml (without the `server` extra) run
`lattice jobs` against a live service, in a fresh venv where torch, Ray, FastAPI and SQLAlchemy are absent.

The venv gets exactly the distributions the base dependencies need (their transitive requirements,
read from the installed metadata), linked from this environment: no network, and nothing else leaks in.
"""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
import venv
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from tests.cli.test_cli import ROOT, Server, server  # noqa: F401 - the module-scoped live service

SERVER_ONLY = ("torch", "ray", "fastapi", "sqlalchemy", "numpy", "uvicorn")


def _closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements pull in (markers evaluated for this interpreter, no extras)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = metadata.distribution(req.name).metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo.extend(Requirement(r) for r in metadata.distribution(name).requires or [])
    return seen


def _top_level(dist_name: str) -> set[Path]:
    """The files and folders a distribution installed at the top of site-packages."""
    dist = metadata.distribution(dist_name)
    tops = set()
    for f in dist.files or []:
        first = Path(str(f)).parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".data"):  # .dist-info: the metadata
            tops.add(Path(str(dist.locate_file(first))))
    return tops


def _client_venv(where: Path) -> Path:
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dists = _closure(base)
    assert not {re.sub(r"[-_.]+", "-", d) for d in dists} & set(SERVER_ONLY), dists
    venv.create(where, with_pip=False)
    site = next(where.glob("lib/python3*/site-packages"))
    for dist in dists:
        for path in _top_level(dist):
            if path.exists() and not (site / path.name).exists():
                (site / path.name).symlink_to(path)
    (site / "lattice-src.pth").write_text(str(ROOT) + "\n")  # the project itself, without its extras
    return where / "bin" / "python"


def test_the_client_install_runs_lattice_jobs_without_torch_or_ray(server: Server, tmp_path: Path) -> None:  # noqa: F811
    python = _client_venv(tmp_path / "client")
    probe = subprocess.run([python, "-c", "import importlib.util as u; print([m for m in "
                            f"{list(SERVER_ONLY)!r} if u.find_spec(m)])"], capture_output=True, text=True)
    assert probe.stdout.strip() == "[]", probe.stderr  # the server's packages are really absent
    token = (server.home / "token").read_text().strip()
    env = {"PATH": "/usr/bin:/bin", "LATTICE_SERVER": server.url, "LATTICE_TOKEN": token,
           "LATTICE_HOME": str(tmp_path / "client-home")}
    cli = [python, "-c", "from service.cli import app; app()"]
    listed = subprocess.run([*cli, "jobs", "-o", "json"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert isinstance(json.loads(listed.stdout), dict | list)
    local = subprocess.run([*cli, "token", "create", "--tenant", "x"], capture_output=True, text=True,
                           env=env, timeout=120)
    assert local.returncode == 1 and "lattice[server]" in local.stderr and "Traceback" not in local.stderr
