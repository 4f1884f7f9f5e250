"""A shared embedded cluster: `lattice cluster up|down|status`.

`up` starts the embedded virtual-GPU cluster (workers.cluster) *detached*: its Ray processes
outlive the command, and its address goes to `<home>/ray_address` (mode 0600) with the process
ids in `<home>/ray_cluster.json`. Any role (`lattice serve --role api|scheduler|all`) with no
LATTICE_RAY_ADDRESS joins that cluster instead of starting its own, so several processes share one
cluster. `down` stops exactly the processes `up` started (by id and start time, never by name:
other Ray clusters of this user keep running) and removes both files.

Ray is imported only inside `start_detached`; reading the address file needs no Ray.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workers.cluster import ClusterError, descendants, start_embedded_cluster

log = logging.getLogger(__name__)

ADDRESS_FILE = "ray_address"
STATE_FILE = "ray_cluster.json"
_FILE_MODE = 0o600


@dataclass(frozen=True)
class SharedClusterState:
    address: str
    temp_dir: str
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, start time in clock ticks)
    gpus: int = 0
    nodes: int = 0
    started_at: float = 0.0


def address_path(home: Path) -> Path:
    return home / ADDRESS_FILE


def _write_private(path: Path, text: str) -> None:
    """A file that is 0600 from its first byte."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, _FILE_MODE)


def read_address(home: Path) -> str | None:
    """The shared cluster's address from `<home>/ray_address`, or None when there is none."""
    try:
        text = address_path(home).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


def read_state(home: Path) -> SharedClusterState | None:
    try:
        raw = json.loads((home / STATE_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    procs = [(int(p), int(t)) for p, t in raw.get("processes", [])]
    return SharedClusterState(
        address=str(raw["address"]), temp_dir=str(raw.get("temp_dir", "")), processes=procs,
        gpus=int(raw.get("gpus", 0)), nodes=int(raw.get("nodes", 0)),
        started_at=float(raw.get("started_at", 0)),
    )


def write_state(home: Path, state: SharedClusterState) -> None:
    _write_private(home / STATE_FILE, json.dumps(asdict(state)) + "\n")
    _write_private(address_path(home), state.address + "\n")


def clear_state(home: Path) -> None:
    for name in (ADDRESS_FILE, STATE_FILE):
        try:
            (home / name).unlink()
        except FileNotFoundError:
            pass


def process_start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot, /proc/<pid>/stat field 22); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
    if fields[0] == "Z":  # a zombie is gone for our purposes
        return None
    return int(fields[19])


def _alive(procs: list[tuple[int, int]]) -> list[int]:
    return [pid for pid, started in procs if process_start_time(pid) == started]


def is_up(state: SharedClusterState) -> bool:
    """True while the head's processes that `up` recorded still run (the first is the head's GCS)."""
    return bool(state.processes) and bool(_alive(state.processes[:1]))


def live_address(home: Path) -> str | None:
    """The address a role should join when LATTICE_RAY_ADDRESS is unset: the shared cluster's,
    while it runs; None when there is none or the recorded one has died (a stale file)."""
    address = read_address(home)
    if address is None:
        return None
    state = read_state(home)
    if state is not None and not is_up(state):
        log.warning("the shared cluster recorded in %s is not running; ignoring it", address_path(home))
        return None
    return address


def start_detached(
    home: Path, *, racks: int, nodes_per_rack: int, gpus_per_node: int, temp_dir: str,
    timeout_s: float = 120.0,
) -> SharedClusterState:
    """Start the embedded cluster with processes that outlive this one; record it under `home`."""
    existing = read_state(home)
    if existing is not None and is_up(existing):
        raise ClusterError(f"a shared cluster is up at {existing.address}; run `lattice cluster down`")
    embedded = start_embedded_cluster(
        racks=racks, nodes_per_rack=nodes_per_rack, gpus_per_node=gpus_per_node, temp_dir=temp_dir,
        connect_driver=False, detached=True, timeout_s=timeout_s,
    )
    procs: list[tuple[int, int]] = []
    for node in embedded.ray_nodes():  # the head's GCS first: is_up() looks at it
        for kind in sorted(node.all_processes, key=lambda k: (k != "gcs_server", k)):
            for info in node.all_processes[kind]:
                started = process_start_time(info.process.pid) if info.process else None
                if started is not None:
                    procs.append((info.process.pid, started))
    state = SharedClusterState(
        address=embedded.address, temp_dir=temp_dir, processes=procs,
        gpus=racks * nodes_per_rack * gpus_per_node, nodes=racks * nodes_per_rack, started_at=time.time(),
    )
    write_state(home, state)
    log.info("shared cluster up at %s (%d processes)", state.address, len(procs))
    return state


def stop(home: Path, grace_s: float = 2.0) -> int:
    """Stop the processes `up` recorded (and their children); remove the files. Returns how many
    processes were signalled (0: nothing was running)."""
    state = read_state(home)
    if state is None:
        clear_state(home)
        return 0
    roots = _alive(state.processes)
    victims = roots + [p for p in descendants(roots) if p not in roots]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(process_start_time(p) is not None for p in victims):
        time.sleep(0.1)
    for pid in victims:
        if process_start_time(pid) is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    clear_state(home)
    return len(victims)
