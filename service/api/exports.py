"""Asynchronous exports of a job's checkpoints. The API process never imports torch: an export runs
as a subprocess (`python -m training.interop.export`) that keeps a JSON status file in the job's
folder, `<checkpoint_root>/<job_id>/exports/<export_id>.json`; `GET` reads that file. The files go to
a new folder inside the data root, so an export can be named by `model.init_from` of a later job.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from service.errors import InvalidRequest, NotFound
from service.schemas.exports import ExportCreate, ExportPublic
from service.settings import Settings
from service.store.models import Job
from training.data.confined import inside

EXPORT_ID_CHARS = "0123456789abcdef"
_REPO = Path(__file__).resolve().parents[2]


def exports_dir(settings: Settings, job_id: str) -> Path:
    assert settings.checkpoint_root is not None
    return settings.checkpoint_root / job_id / "exports"


def resolve_output(settings: Settings, output: str | None, default: str) -> Path:
    """A new (or empty) folder inside the data root; refused naming `output` otherwise."""
    root = os.path.realpath(settings.data_root_path)
    path = output or default
    candidate = path if os.path.isabs(path) else os.path.join(root, path)
    real = os.path.realpath(candidate)
    if not inside(real, root) or real == root:
        message = (f"{path!r} must be a new folder inside the data root (a path relative to it, or an "
                   "absolute path under it; no '..' or links out of it)")
        raise InvalidRequest(f"output: {message}", errors=[{"field": "output", "message": message}])
    if os.path.exists(real) and (not os.path.isdir(real) or os.listdir(real)):
        message = f"{path!r} already exists; choose a new folder"
        raise InvalidRequest(f"output: {message}", errors=[{"field": "output", "message": message}])
    return Path(real)


def start_export(settings: Settings, job: Job, request: ExportCreate) -> ExportPublic:
    """Check the request, write the status file, start the export process; returns the status."""
    assert settings.checkpoint_root is not None
    ckpt_root = settings.checkpoint_root / job.id
    steps = sorted(int(p.name[5:]) for p in ckpt_root.glob("step-*")
                   if p.is_dir() and p.name[5:].isdigit())
    if not steps:
        raise InvalidRequest(f"job {job.id!r} has no checkpoint to export yet",
                             errors=[{"field": "step", "message": "the job has no checkpoint yet"}])
    if request.step is not None and request.step not in steps:
        message = f"no checkpoint of step {request.step}; the job has steps {steps}"
        raise InvalidRequest(f"step: {message}", errors=[{"field": "step", "message": message}])
    export_id = "".join(secrets.choice(EXPORT_ID_CHARS) for _ in range(16))
    output = resolve_output(settings, request.output, f"exports/{job.id}-{export_id}")
    folder = exports_dir(settings, job.id)
    folder.mkdir(parents=True, exist_ok=True)
    status_file = folder / f"{export_id}.json"
    status = {"id": export_id, "job_id": job.id, "state": "running", "format": request.format,
              "step": request.step, "output": str(output), "created": time.time()}
    status_file.write_text(json.dumps(status))
    cmd = [sys.executable, "-m", "training.interop.export", "--checkpoints", str(ckpt_root),
           "--format", request.format, "--output", str(output), "--status", str(status_file),
           "--data-root", os.path.realpath(settings.data_root_path)]
    if request.step is not None:
        cmd += ["--step", str(request.step)]
    paths = [str(_REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with open(folder / f"{export_id}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_REPO,
                                start_new_session=True)
    threading.Thread(target=_reap, args=(proc, status_file), daemon=True).start()
    return _public(status)


def _reap(proc: subprocess.Popen[bytes], status_file: Path) -> None:
    """Wait for the export process; one that died without a verdict is marked failed."""
    code = proc.wait()
    status = _read(status_file)
    if status is not None and status.get("state") == "running":
        status.update(state="failed", error=f"the export process exited with code {code} without a result")
        tmp = status_file.with_name(status_file.name + ".tmp")
        tmp.write_text(json.dumps(status))
        os.replace(tmp, status_file)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _public(status: dict[str, Any]) -> ExportPublic:
    result = status.get("result")
    return ExportPublic(
        id=status["id"], job_id=status["job_id"], state=status["state"], format=status["format"],
        step=(result or {}).get("step", status.get("step")), output=status["output"],
        files=(result or {}).get("files", []), error=status.get("error"), result=result,
    )


def get_export(settings: Settings, job: Job, export_id: str) -> ExportPublic:
    status = _read(exports_dir(settings, job.id) / f"{export_id}.json")
    if status is None:
        raise NotFound(f"export {export_id!r} of job {job.id!r} not found")
    return _public(status)
