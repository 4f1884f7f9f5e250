"""Shared pieces of the data-parallel benchmarks: a rank spawner, the ~20M-parameter model, timing, tables.

The spawner follows the hardware like the train entry points do (NCCL + one GPU per rank when CUDA
has enough devices, gloo on CPU otherwise) and returns what rank 0's function returns.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from training.parallel.local_ranks import run_local_ranks

T = TypeVar("T")


def spawn(world: int, fn: Callable[..., Any], args: tuple = (), timeout_s: float = 1200.0) -> Any:
    """Run `fn(rank, world, *args)` on `world` processes; return rank 0's result (plain Python data)."""
    return run_local_ranks(world, fn, args, timeout_s=timeout_s)[0]


def bench_device(rank: int) -> torch.device:
    if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def build_bench_model(seed: int, device: torch.device) -> tuple[nn.Module, Callable[..., torch.Tensor], int]:
    """The project's GPT model at ~21M parameters (6 x 512, vocab 2048), or a torch.nn stand-in.

    Returns (model, loss_fn(model, tokens) -> loss, vocab).
    """
    vocab = 2048
    try:
        from training.config.spec import ModelSpec
        from training.model.transformer import build_model, cross_entropy_loss

        spec = ModelSpec(layers=6, hidden=512, heads=8, vocab=vocab, seq_len=128, name="bench-21m")
        model = build_model(spec, seed=seed, device=device)

        def loss_fn(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(m(tokens[:, :-1]), tokens[:, 1:])

        return model, loss_fn, vocab
    except Exception:  # noqa: BLE001 - the project's model is optional for the benchmark
        torch.manual_seed(seed)
        model = _TorchNNTransformer(vocab).to(device)

        def nn_loss(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
            logits = m(tokens[:, :-1])
            return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        return model, nn_loss, vocab


class _TorchNNTransformer(nn.Module):
    def __init__(self, vocab: int, d: int = 512, layers: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.blocks(self.emb(x), mask=mask, is_causal=True))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0.0

    def __enter__(self) -> Timer:
        sync(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        sync(self.device)
        self.elapsed = time.perf_counter() - self.start


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{datetime.date.today().isoformat()}, {platform.machine()} {os.cpu_count()} cores, {gpu}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        return f"{c:.3f}" if abs(c) < 100 else f"{c:.1f}"
    return str(c)


def wait_for(what: Callable[[], T | None], timeout_s: float, message: str, poll_s: float = 0.05) -> T:
    """`what()`'s first truthy value, polled every `poll_s`; RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {message}")
        time.sleep(poll_s)


def healthz_up(base: str) -> bool:
    """Whether the `lattice serve` at `base` answers /healthz with 200."""
    import httpx

    try:
        return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
