"""The ranks' flight recorders on a hang: where they are dumped and what the hang event says of them.

Layout (in the job's folder, `<checkpoint_root>/<job_id>`, next to `logs/`):

    flight_recorder/rank-<r>.json   rank r's recent collectives, written on the controller's request
                                    (`RankActor.dump_collectives`, torch's flight recorder as JSON)
    flight_recorder/rank-<r>        NCCL's own dump when its watchdog timed a collective out (pickle;
                                    pointed at, never loaded here)

When the controller finds a hang it asks every live rank to dump, then `annotate_hang` appends each
rank's last collective (its name, sequence number and state) and the folder to the hang's message and
evidence. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from workers.policies import Failure

log = logging.getLogger(__name__)

TRACE_SUBDIR = "flight_recorder"
_MAX_DUMP_BYTES = 64 * 2**20  # a 2000-entry ring is a few MB; anything larger is not ours


def trace_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / TRACE_SUBDIR


def watchdog_prefix(job_dir: str | os.PathLike[str]) -> str:
    """TORCH_FR_DUMP_TEMP_FILE for the job's ranks (NCCL appends the rank)."""
    return str(trace_dir(job_dir) / "rank-")


def dump_path(job_dir: str | os.PathLike[str], rank: int) -> Path:
    return trace_dir(job_dir) / f"rank-{rank}.json"


def last_collective(dump: dict[str, Any]) -> dict[str, Any] | None:
    """The newest entry of one flight-recorder dump (highest record id), as a small dict."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    if not entries:
        return None
    last = max(entries, key=lambda e: int(e.get("record_id") or 0))
    group = last.get("process_group") or ["", ""]
    return {"op": str(last.get("profiling_name") or "?"), "seq": last.get("collective_seq_id"),
            "state": str(last.get("state") or "?"), "group": str(group[-1] if group else ""),
            "p2p": bool(last.get("is_p2p"))}


def read_last_collectives(job_dir: str | os.PathLike[str], ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    """{rank: its last collective} for the ranks whose JSON dump is there and readable."""
    out: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        path = dump_path(job_dir, rank)
        try:
            if path.stat().st_size > _MAX_DUMP_BYTES:
                continue
            found = last_collective(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            log.debug("no flight recorder of rank %d at %s: %s", rank, path, e)
            continue
        if found is not None:
            out[rank] = found
    return out


def clear_dumps(job_dir: str | os.PathLike[str]) -> None:
    """Remove the JSON dumps of an earlier request (NCCL's own dumps stay)."""
    try:
        for path in trace_dir(job_dir).glob("rank-*.json"):
            path.unlink(missing_ok=True)
    except OSError as e:
        log.debug("could not clear old flight recorder dumps: %s", e)


def describe(last: dict[int, dict[str, Any]]) -> str:
    """"rank 0 gloo:all_reduce #12 (started), rank 1 ..." in rank order."""
    return ", ".join(f"rank {r} {c['op']} #{c['seq']} ({c['state']})" for r, c in sorted(last.items()))


def annotate_hang(
    failure: Failure, job_dir: str | None, ranks: Iterable[int], dump: Callable[[], None] | None = None
) -> Failure:
    """The hang `failure` with each rank's last collective from the flight recorders (after asking
    the ranks to `dump`) added to its message and evidence; unchanged without a job folder or dumps."""
    if not job_dir:
        return failure
    if dump is not None:
        clear_dumps(job_dir)  # an earlier hang's dumps must not speak for a rank that cannot dump now
        try:
            dump()
        except Exception as e:  # noqa: BLE001 - evidence is best effort; the hang is handled regardless
            log.warning("flight recorder dump failed: %s", e)
    folder = trace_dir(job_dir)
    last = read_last_collectives(job_dir, ranks)
    try:
        files = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    except OSError:
        files = []
    if not last and not files:
        return failure
    recorder = {"dir": str(folder), "files": files, "last_collective": {str(r): c for r, c in last.items()}}
    evidence = {**failure.evidence, "flight_recorder": recorder}
    note = f"; last collectives: {describe(last)}" if last else ""
    return dataclasses.replace(failure, message=f"{failure.message}{note} (flight recorder: {folder})",
                               evidence=evidence)
