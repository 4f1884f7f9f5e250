"""Process-group plumbing shared by the train entry points, the rank actors and the tests.

Backend follows the hardware: NCCL when CUDA is present, gloo on CPU. Ports are never
hard-coded: `free_port()` finds one free, below the range the OS gives outgoing connections.

On CUDA a rank uses the first GPU it can see: a Ray rank actor (`num_gpus=1`) sees exactly the GPU Ray
assigned it (Ray sets CUDA_VISIBLE_DEVICES per actor, and the actor sets LOCAL_RANK=0); under torchrun
every process sees the node's GPUs and LOCAL_RANK picks one. The device is made current
(`torch.cuda.set_device`) before the process group exists and handed to `init_process_group`
(`device_id`), so NCCL binds its communicator to it eagerly instead of guessing from the rank.

The flight recorder (torch's ring buffer of each process group's recent collectives) is on for NCCL
and for a rank given a dump location (`enable_flight_recorder`, before the group is created): NCCL's
watchdog writes it to `TORCH_FR_DUMP_TEMP_FILE<rank>` when a collective times out, and
`dump_flight_recorder` writes it as JSON on request (the controller asks the ranks for it on a
hang: workers.collective_trace).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.parallel.links import GlooLinks

# torch 2.13 names it all_gather_single and deprecates all_gather_into_tensor; torch <= 2.12 (a GPU
# image's own torch, say) has only the old name. Same arguments, same result.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

log = logging.getLogger(__name__)


# The OS hands out ports of ip_local_port_range to every outgoing connection (Ray's gRPC opens many), so a
# port picked there and bound seconds later (a rendezvous master's: picked by rank 0's actor, bound when
# the ranks start) can be taken meanwhile: EADDRINUSE, and a job restarted for nothing (CI, 2026-12-08).
# Listening ports are drawn above Ray's worker ports (10002-19999 by default) and below that range.
LISTEN_PORT_LOW = 20000
_PORT_TRIES = 64


def ephemeral_port_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now, outside the ephemeral range when the host leaves room below it
    (else whatever the OS gives)."""
    import random

    high = ephemeral_port_low() - 1
    draw = random.SystemRandom()  # not the seeded global generator: ranks seeded alike would all collide
    for _ in range(_PORT_TRIES if high > LISTEN_PORT_LOW else 0):
        port = draw.randint(LISTEN_PORT_LOW, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device (training.config.hardware); None on CPU or when unknown."""
    if device.type != "cuda":
        return None
    from training.config.hardware import peak_flops_of_device

    return peak_flops_of_device(torch.cuda.get_device_name(device))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device() -> torch.device:
    """cuda:LOCAL_RANK of the visible GPUs (cuda:0 in a Ray rank actor, which sees only its own), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


# Collectives kept per process group by the flight recorder (torch's default when enabled is 2000).
FLIGHT_RECORDER_ENTRIES = 2000


def flight_recorder_env(dump_prefix: str | None) -> dict[str, str]:
    """The environment that turns the flight recorder on (read when a process group is created).

    TORCH_FR_* are torch >= 2.8's names for TORCH_NCCL_TRACE_BUFFER_SIZE and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE; TORCH_NCCL_DUMP_ON_TIMEOUT has no new name."""
    env = {"TORCH_FR_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if dump_prefix:
        env["TORCH_FR_DUMP_TEMP_FILE"] = dump_prefix  # the watchdog's dump: <prefix><rank>
    return env


def enable_flight_recorder(dump_prefix: str | None) -> None:
    """Set `flight_recorder_env` in this process, keeping values the operator set already."""
    for key, value in flight_recorder_env(dump_prefix).items():
        os.environ.setdefault(key, value)
    if dump_prefix:
        try:
            Path(dump_prefix).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the watchdog then cannot write its dump; training goes on
            log.warning("no flight recorder folder at %s: %s", Path(dump_prefix).parent, e)


def dump_flight_recorder(path: str | os.PathLike[str], backend: str) -> str | None:
    """Write this process's flight recorder (every group's recent collectives) to `path` as JSON.

    Returns the path, or None when this torch build has no flight recorder for `backend` or nothing
    could be written (a dump is evidence, never a reason to fail)."""
    import torch._C._distributed_c10d as c10d

    names = (["_dump_nccl_trace_json"] if backend == "nccl" else []) + ["_dump_fr_trace_json"]
    for name in names:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            data = dump(True, False)  # (include collectives, only active ones)
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data if isinstance(data, bytes) else str(data).encode())
            return str(target)
        except (RuntimeError, OSError, TypeError) as e:  # TypeError: another torch's signature
            log.warning("flight recorder dump (%s) failed: %s", name, e)
    return None


_links: GlooLinks | None = None


def gloo_links() -> GlooLinks | None:
    """The gloo connections of this process's current group (None: not gloo, or not joined here)."""
    return _links


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    backend: str


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 120.0,
    trace_prefix: str | None = None,
) -> DistContext:
    """Join the default process group over TCP and return who we are.

    `timeout_s` bounds the rendezvous and every collective (NCCL's watchdog aborts a collective
    that runs longer); `trace_prefix`: where NCCL's watchdog dumps the flight recorder on a timeout."""
    backend = backend or default_backend()
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL's communicator lives on the current device
    if backend == "nccl" or trace_prefix:
        enable_flight_recorder(trace_prefix)
    if not dist.is_initialized():
        global _links
        _links = GlooLinks() if backend == "gloo" else None  # the sockets before: not gloo's
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # NCCL: bind the communicator to this GPU now (eager init) rather than at the first collective.
            device_id=device if backend == "nccl" else None,
        )
    log.debug("rank %d/%d joined %s at %s:%d", rank, world_size, backend, master_addr, master_port)
    return DistContext(rank=rank, world_size=world_size, device=device, backend=backend)


def init_from_env() -> DistContext:
    """torchrun-style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment."""
    return init_distributed(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(os.environ["MASTER_PORT"]),
    )


# How long the main thread lets gloo's worker threads take the GIL after the groups are destroyed.
_RETIRE_S = 0.1


def shutdown() -> None:
    """Leave every process group so that the process can exit without aborting.

    A gloo worker thread retires a finished collective after the caller's `wait()` has returned;
    when the collective's tensors were created in Python (a broadcast buffer, a pickled object, DCP's
    plans) and Python has already dropped them, the worker drops the last reference and must take the
    GIL to free the Python object. If the interpreter is already finalizing, CPython ends that thread
    with a forced unwind through a noexcept frame and the process dies with "terminate called without an
    active exception" (SIGABRT) after training succeeded. The groups' C++ objects, and so their
    threads, outlive `destroy_process_group()` once torch._dynamo is imported (every optimizer imports
    it), so joining them is not in our hands: destroy the groups, collect what Python still holds, and
    release the GIL long enough for the workers to retire their last collectives (they are waiting for
    it, so they run as soon as the main thread sleeps).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    time.sleep(_RETIRE_S)


def gather_object(value: Any) -> list[Any]:
    """`value` from every rank of the world, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def agree_flags(flags: list[bool], device: torch.device) -> list[bool]:
    """Logical OR of each flag over all ranks."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]
