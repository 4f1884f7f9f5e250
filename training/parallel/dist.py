"""Process-group plumbing shared by the train entry points, the rank actors and the tests.

Backend follows the hardware: NCCL when CUDA is present, gloo on CPU. Ports are never
hard-coded: `free_port()` asks the OS.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
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
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


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
) -> DistContext:
    """Join the default process group over TCP and return who we are."""
    backend = backend or default_backend()
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
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
