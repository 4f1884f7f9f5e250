"""Free the peers a failed rank leaves behind inside a collective (gloo).

When a rank dies, the ranks in a collective with it fail out of that collective and leave the step;
a survivor still inside another collective with one of *them* waits for a peer that will never
come (HSDP: rank 2 in the replicate all-reduce with rank 0, which already left the reduce-scatter
it shared with the dead rank 1). Gloo notices only when the peer's TCP connection closes, and
neither `destroy_process_group`, `ProcessGroup.abort` nor `shutdown` closes it on CPU (torch 2.13,
measured: only the process's exit does), so the survivor waits for the collective timeout and the
peer recovery gives up on it. NCCL has `abort` for this; gloo gets `sever`.

`GlooLinks.record` (collective, after the groups are built) learns every rank's gloo listening
ports: the sockets this process listens on that were not there before `init_distributed`.
`sever` (a rank leaving a failed attempt, after it kept its state) shuts down this process's TCP
connections that are gloo pairs — accepted on one of its own gloo ports, or connected to one of the
job's — so every peer blocked on it fails at once and leaves in turn. Ray's sockets (they existed
before, or talk to no gloo port) are left alone. Linux only (/proc); elsewhere it does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger(__name__)

_LISTEN, _ESTABLISHED = "0A", "01"


def _own_sockets() -> dict[int, int]:
    """inode -> file descriptor of every socket this process holds."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def _tcp() -> list[tuple[int, int, str, int]]:
    """(local port, remote port, state, inode) of every TCP socket in this network namespace."""
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            rows.append((int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), f[3], int(f[9])))
    return rows


class GlooLinks:
    """This process's gloo connections of one attempt (see the module docstring)."""

    def __init__(self) -> None:
        mine = _own_sockets()
        self._before = {inode for _, _, state, inode in _tcp() if state == _LISTEN and inode in mine}
        self.mine: set[int] = set()  # this rank's gloo listening ports
        self.ports: set[int] = set()  # every rank's

    def listening_ports(self) -> set[int]:
        mine = _own_sockets()
        return {port for port, _, state, inode in _tcp()
                if state == _LISTEN and inode in mine and inode not in self._before}

    def record(self) -> None:
        """Every rank's gloo listening ports (a collective over the world: every rank calls it).
        A world of one has no peers to free: nothing to record."""
        if dist.get_world_size() == 1:
            return
        self.mine = self.listening_ports()
        gathered: list[set[int] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.mine)
        self.ports = set().union(*(g or set() for g in gathered))

    def sever(self) -> int:
        """Shut down this process's gloo pair connections; returns how many."""
        mine = _own_sockets()
        doomed = {inode for local, remote, state, inode in _tcp()
                  if inode in mine and state == _ESTABLISHED and (local in self.mine or remote in self.ports)}
        for inode in doomed:
            fd = mine[inode]
            try:  # on a duplicate: the connection ends, gloo keeps (and later closes) its own fd
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError as e:
                log.debug("sever socket %d: %s", inode, e)
        if doomed:
            log.info("severed %d gloo connections so that peers blocked on this rank fail too", len(doomed))
        return len(doomed)
