"""Validation loss on a held-out split (``data.validation``), the same for every layout of a job.

The held-out samples (never trained on):

- ``path``: the windows of another token file or shard folder, in file order;
- ``fraction``: the last ``ceil(fraction * n_windows)`` windows of the training files, which the
  training source then never visits (``TokenFileSource(holdout=...)``);
- synthetic data with ``fraction``: samples numbered from ``SYNTHETIC_BASE`` on, far beyond any
  training index (the stream is infinite, so the fraction only selects this held-out range).

An evaluation reads ``batches`` global batches of them (always the same samples, in the same
order), each DP rank its slice as in training (``DataSource.positions``), runs the forward pass
only (under a pipeline schedule with ``schedule.eval``), and takes the mean of the per-rank token
means over the replicas with the step's own reduction (``Trainer.step_summary``): the mean loss
over all held-out tokens, identical on every rank and for any layout up to float rounding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from training.config.run import RunConfig, ValidationConfig
from training.data.sources import DataError, DataSource, TokenFileSource

if TYPE_CHECKING:
    from training.train import Trainer

SYNTHETIC_BASE = 1 << 62  # synthetic validation sample indices start here


class HeldOutSource(DataSource):
    """Held-out samples 0, 1, 2, ... read through `read` (wrapping around after `count`)."""

    kind = "validation"

    def __init__(self, read: Callable[[list[int]], torch.Tensor], count: int | None, identity: str,
                 seq_len: int, vocab: int, global_batch: int) -> None:
        super().__init__(0, seq_len, vocab, global_batch)
        self.read, self.count, self.identity = read, count, identity

    def fingerprint(self) -> str:
        return hashlib.sha256(self.identity.encode()).hexdigest()

    def _samples(self, indices: list[int]) -> torch.Tensor:
        return self.read([i % self.count if self.count else i for i in indices])


def _windows(source: TokenFileSource, first: int) -> Callable[[list[int]], torch.Tensor]:
    def read(indices: list[int]) -> torch.Tensor:
        return torch.stack([source.window_tokens(first + i) for i in indices])  # (n, seq_len + 1)
    return read


def validation_source(cfg: RunConfig, train_source: DataSource) -> HeldOutSource | None:
    """The held-out samples of `cfg.data.validation` (None when there is no validation)."""
    val: ValidationConfig | None = cfg.data.validation
    if val is None:
        return None
    spec, batch = cfg.model, cfg.global_batch
    if val.path is not None:
        src = TokenFileSource(val.path, 0, spec.seq_len, spec.vocab, batch, dtype=cfg.data.dtype,
                              root=cfg.data.root, field="data.validation.path")
        return HeldOutSource(_windows(src, 0), src.n_windows, f"path {src.fingerprint()}",
                             spec.seq_len, spec.vocab, batch)
    if isinstance(train_source, TokenFileSource):
        n_train = train_source.n_windows
        return HeldOutSource(_windows(train_source, n_train), train_source.n_heldout,
                             f"heldout {train_source.fingerprint()}", spec.seq_len, spec.vocab, batch)
    if train_source.kind == "synthetic":
        return HeldOutSource(lambda idx: train_source.samples([SYNTHETIC_BASE + i for i in idx]), None,
                             f"synthetic {train_source.fingerprint()}", spec.seq_len, spec.vocab, batch)
    raise DataError(f"data.validation is not supported for data.kind {train_source.kind!r}")


@torch.no_grad()
def local_loss(trainer: Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """This rank's mean held-out loss of one batch slice (None on pipeline ranks without the head)."""
    pipeline, n = trainer.pipeline, trainer.cfg.layout.num_microbatches
    if pipeline is not None:
        losses: list[torch.Tensor] = []
        if pipeline.has_first:
            pipeline.schedule.eval(inputs, target=targets, losses=losses)
        else:
            pipeline.schedule.eval(target=targets, losses=losses)
        return torch.stack([x.detach().float() for x in losses]).mean() if pipeline.has_last else None
    part = trainer.parts[0]  # the model itself: no gradient hooks run under no_grad
    total = torch.zeros((), device=trainer.ctx.device)
    for x, y in zip(inputs.chunk(n), targets.chunk(n), strict=True):
        total += part.loss(part(x), y).float() / n
    return total


def evaluate(trainer: Trainer, source: HeldOutSource, batches: int) -> float:
    """The mean held-out loss over `batches` global batches (every rank calls; the same result)."""
    dims, device = trainer.dims, trainer.ctx.device
    values = []
    for b in range(batches):
        inputs, targets = source.batch(b, dims.dp_rank, dims.dp_size)
        local = local_loss(trainer, inputs.to(device), targets.to(device))
        values.append(trainer.step_summary(local, None)[0])
    return sum(values) / len(values)


def offline_loss(state: dict[str, torch.Tensor], cfg: RunConfig) -> float:
    """The same number from a consolidated state dict on one process (for checks and tests)."""
    from training.data.sources import make_data_source
    from training.model.transformer import Transformer, cross_entropy_loss

    assert cfg.data.validation is not None
    source = validation_source(cfg, make_data_source(cfg.data, cfg.model, cfg.global_batch))
    assert source is not None
    model = Transformer(cfg.model)
    model.load_state_dict(state)
    values = []
    with torch.no_grad():
        for b in range(cfg.data.validation.batches):
            inputs, targets = source.batch(b, 0, 1)
            values.append(float(cross_entropy_loss(model(inputs), targets)))
    return sum(values) / len(values)
