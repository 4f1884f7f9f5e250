"""`free_port` (training/parallel/dist.py): a rendezvous port outside the range the kernel gives outgoing
connections, where a port picked now and bound seconds later can be taken meanwhile (EADDRINUSE)."""

from __future__ import annotations

import random
import socket

import pytest

from training.parallel import dist as pdist


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_come_from_below_the_ephemeral_range_and_above_rays_worker_ports() -> None:
    low = pdist.ephemeral_port_low()
    assert low > pdist.LISTEN_PORT_LOW  # this host leaves room (Linux default: 32768)
    ports = [pdist.free_port() for _ in range(50)]
    assert all(pdist.LISTEN_PORT_LOW <= p < low for p in ports)
    assert all(_bindable(p) for p in ports[:5])


def test_a_seeded_global_generator_does_not_make_processes_pick_the_same_ports() -> None:
    random.seed(0)
    first = [pdist.free_port() for _ in range(5)]
    random.seed(0)
    assert [pdist.free_port() for _ in range(5)] != first


def test_a_port_taken_is_skipped_and_no_room_below_the_range_falls_back_to_the_os(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Only the taken port and one other fit between the bounds: the taken one is never returned.
        monkeypatch.setattr(pdist, "LISTEN_PORT_LOW", taken)
        monkeypatch.setattr(pdist, "ephemeral_port_low", lambda: taken + 2)
        got = {pdist.free_port() for _ in range(10)}
        assert taken not in got and got <= {taken + 1} | set(range(32768, 65536))
    monkeypatch.setattr(pdist, "ephemeral_port_low", lambda: 1024)
    port = pdist.free_port()
    assert _bindable(port)
