"""The embedded Ray cluster listens on loopback only: Ray has no authentication of its own, and
anyone who reaches the GCS, a raylet or a dashboard agent can run code as the service's user.

The check reads the kernel's socket tables (/proc/net/tcp, /proc/net/tcp6) and maps each LISTEN
socket to its owner through /proc/<pid>/fd: every socket of this process (the driver) and of
everything it started (the head's GCS, the raylets, workers, dashboard and runtime-env agents)
must be bound to 127.0.0.1 / ::1 (or ::ffff:127.0.0.1)."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.ray_fixture import ray_cluster
from workers.cluster import EmbeddedClusterConfig, _descendants, _is_loopback, _node_args

__all__ = ["ray_cluster"]

LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


@dataclass(frozen=True)
class Listener:
    pid: int
    command: str
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)
        return (mapped or self.address).is_loopback


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} print the address as 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_sockets() -> dict[str, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """Socket inode -> (local address, port) of every TCP socket in LISTEN state."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            out[fields[9]] = (_decode(address), int(port, 16))
    return out


def listeners_of(pids: list[int]) -> list[Listener]:
    sockets = listening_sockets()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target.removeprefix("socket:[").removesuffix("]")
            if target.startswith("socket:[") and inode in sockets:
                found.append(Listener(pid, command, *sockets[inode]))
    return found


def test_decode_proc_net_addresses() -> None:
    assert _decode("0100007F") == ipaddress.ip_address("127.0.0.1")
    assert _decode("00000000") == ipaddress.ip_address("0.0.0.0")
    assert _decode("020200C0") == ipaddress.ip_address("192.0.2.2")
    assert _decode("00000000000000000000000001000000") == ipaddress.ip_address("::1")
    mapped = Listener(1, "x", _decode("0000000000000000FFFF00000100007F"), 1)
    assert str(mapped.address) == "::ffff:7f00:1" and mapped.loopback
    assert not Listener(1, "x", _decode("00000000000000000000000000000000"), 1).loopback


def test_every_node_of_the_embedded_cluster_is_told_to_bind_loopback() -> None:
    cfg = EmbeddedClusterConfig()
    assert cfg.host == "127.0.0.1"
    for rack, name in cfg.node_names():
        assert _node_args(cfg, rack, name)["node_ip_address"] == "127.0.0.1"
    assert all(_is_loopback(h) for h in ("127.0.0.1", "::1", "localhost"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "192.0.2.2", "ray-head"))


@pytest.mark.ray
def test_the_embedded_cluster_listens_on_loopback_only(ray_cluster) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def where() -> str:
        return ray.get_runtime_context().get_node_id()

    # a worker process on every simulated node: workers listen too (their own gRPC server)
    node_ids = ray_cluster.node_ids()
    assert node_ids, "no simulated node is alive"
    placed = ray.get([
        where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        for node_id in node_ids.values()
    ], timeout=120)
    assert sorted(placed) == sorted(node_ids.values())

    listeners = listeners_of([os.getpid(), *_descendants([os.getpid()])])
    exposed = [f"{s.command} (pid {s.pid}) on {s.address}:{s.port}" for s in listeners if not s.loopback]
    assert exposed == [], "Ray listens beyond loopback:\n" + "\n".join(exposed)

    # the check saw the cluster: the GCS port, one raylet per node (and the head), the agents
    gcs_host, gcs_port = ray_cluster.address.rsplit(":", 1)
    assert gcs_host == "127.0.0.1"
    assert int(gcs_port) in {s.port for s in listeners}
    raylets = {s.pid for s in listeners if s.command.endswith("/raylet")}
    assert len(raylets) >= len(node_ids) + 1
    assert any(s.command.startswith("ray::DashboardAgent") for s in listeners)
    assert ray.util.get_node_ip_address() == "127.0.0.1"  # the driver itself
