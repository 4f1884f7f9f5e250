"""Training data: deterministic global batches, each DP rank reading a disjoint slice.

Sample numbering. Every sample has a global index ``g``. Step ``s`` consumes the ``global_batch``
consecutive indices starting at ``base_sample + (s - base_step) * global_batch`` (``base_* = 0``
for a fresh run), and DP rank ``r`` of ``n`` gets the contiguous slice
``[r * global_batch // n, (r + 1) * global_batch // n)`` of them. Sample ``g``'s tokens depend
only on (seed, source, g), so the concatenation over DP ranks is the same global batch for any
DP size, and a resumed run (``load_state_dict``) continues at exactly the next unseen index, even
when the resumed run uses another global batch (the anchor ``base_*`` moves to the resume point).

Kinds (``DataConfig.kind``):

- ``"synthetic"``: sequences of a noisy affine recurrence over the vocabulary ``V``:
  ``x[0] ~ U(V)``, then ``x[t+1] = (a * x[t] + b) mod V`` with probability ``1 - p`` and a uniform
  random token with probability ``p = 0.1``. ``a`` (coprime with ``V``) and ``b`` are fixed by the
  seed; each sample's own randomness comes from a generator seeded by (seed, g). A model that
  learns the bigram rule goes from ``ln V`` to the noise floor
  ``H = -q ln q - (V - 1) (p / V) ln(p / V)`` with ``q = 1 - p + p / V`` (entropy of the next-token
  distribution), about 0.9 nats for ``V = 256``; a small transformer gets most of the way within
  ~20 AdamW steps. It is an infinite stream: the epoch is always 0.
- ``"tokens"``: flat files of little-endian token ids, ``data.dtype`` uint16 (nanoGPT's format,
  what ``np.memmap(path, dtype=np.uint16)`` reads) or uint32; ``data.path`` is one file or a folder
  of ``*.bin`` shards read in name order (training.data.token_files), memory-mapped here with ``mmap`` +
  ``torch.frombuffer``. Samples are the non-overlapping windows of ``seq_len + 1`` tokens at
  offsets ``k * seq_len`` of each shard, numbered shard after shard; epoch ``e`` visits all windows
  in the order of a permutation seeded by (seed, e), so no window repeats within an epoch.

Each sample is ``seq_len + 1`` tokens; ``inputs = sample[:-1]``, ``targets = sample[1:]``.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import itertools
import logging
import math
import mmap
import os
import sys
import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

from training.config.run import DataConfig
from training.config.spec import ModelSpec
from training.data.confined import ConfinedPathError, open_confined
from training.data.token_files import TokenFileError, token_files, tokens_in, windows_per_shard

log = logging.getLogger(__name__)

STATE_VERSION = 1
SYNTHETIC_NOISE = 0.1  # probability that the next synthetic token is uniform noise instead of the rule
_MASK64 = (1 << 64) - 1


class DataError(ValueError):
    """Bad data configuration, an unreadable token file, or a resume that does not match the source."""


def _mix_seed(*parts: int) -> int:
    """splitmix64 (Steele et al. 2014) folded over the parts: a well-spread 63-bit generator seed."""
    z = 0
    for part in parts:
        z = (z + (part & _MASK64) + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z & ((1 << 63) - 1)


def _generator(*parts: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(_mix_seed(*parts))
    return g


class DataSource(ABC):
    """Global batches by step; see the module docstring for the numbering."""

    kind: str = ""

    def __init__(self, seed: int, seq_len: int, vocab: int, global_batch: int) -> None:
        if global_batch < 1:
            raise DataError(f"global_batch must be >= 1, got {global_batch}")
        self.seed = int(seed)
        self.seq_len = seq_len
        self.vocab = vocab
        self.global_batch = global_batch
        self._base_step = 0
        self._base_sample = 0
        self._next_step = 0

    # -- what a subclass provides ----------------------------------------------------------------
    @abstractmethod
    def fingerprint(self) -> str:
        """Identity of the source (content and interpretation, not the seed), checked on resume."""

    @abstractmethod
    def _samples(self, indices: list[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64 tokens of the given global sample indices."""

    def epoch_of(self, sample: int) -> int:
        return 0

    def samples(self, indices: list[int]) -> torch.Tensor:
        """(len(indices), seq_len + 1) tokens of the given sample indices (validation reads these)."""
        return self._samples(indices)

    # -- batches ---------------------------------------------------------------------------------
    def positions(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        """Global sample indices of DP rank ``dp_rank``'s slice of step ``step``'s global batch."""
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
        if self.global_batch % dp_size != 0:
            raise DataError(f"dp_size ({dp_size}) must divide the global batch ({self.global_batch})")
        if step < self._base_step:
            raise DataError(f"step {step} precedes the resumed data position (step {self._base_step})")
        local = self.global_batch // dp_size
        first = self._base_sample + (step - self._base_step) * self.global_batch + dp_rank * local
        return list(range(first, first + local))

    def batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 of shape (global_batch // dp_size, seq_len)."""
        tokens = self._samples(self.positions(step, dp_rank, dp_size))  # (B, T + 1)
        self._next_step = step + 1
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    # -- position ------------------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The step after the last one served (or the resume point)."""
        return self._next_step

    @property
    def samples_consumed(self) -> int:
        return self._base_sample + (self._next_step - self._base_step) * self.global_batch

    def state_dict(self, after_step: int | None = None) -> dict[str, Any]:
        """JSON-able data position: resume with ``load_state_dict`` to see exactly the next samples.
        `after_step`: the position once step `after_step` is done, although a later step's batch may
        have been read already (a rank that fails inside a step keeps the state of the step before)."""
        next_step = self._next_step if after_step is None else after_step + 1
        if next_step < self._base_step:
            raise DataError(f"step {after_step} precedes the resumed data position (step {self._base_step})")
        consumed = self._base_sample + (next_step - self._base_step) * self.global_batch
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "fingerprint": self.fingerprint(),
            "global_batch": self.global_batch,
            "next_step": next_step,
            "samples_consumed": consumed,
            "epoch": self.epoch_of(consumed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a position saved from a different source."""
        try:
            version, kind, seed = state["version"], state["kind"], state["seed"]
            seq_len, fingerprint = state["seq_len"], state["fingerprint"]
            next_step, consumed = int(state["next_step"]), int(state["samples_consumed"])
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"data state is malformed (field {e}); keys: {sorted(state)}") from e
        ours = "this run's is"
        if version != STATE_VERSION:
            raise DataError(f"data state version {version} is not supported (expected {STATE_VERSION})")
        if kind != self.kind:
            raise DataError(f"cannot resume: the checkpoint's data kind is {kind!r}, {ours} {self.kind!r}")
        if seed != self.seed:
            raise DataError(f"cannot resume: the checkpoint's data seed is {seed}, {ours} {self.seed}")
        if seq_len != self.seq_len:
            raise DataError(f"cannot resume: the checkpoint's seq_len is {seq_len}, {ours} {self.seq_len}")
        if fingerprint != self.fingerprint():
            raise DataError(
                f"cannot resume: the data source differs from the checkpoint's "
                f"(fingerprint {fingerprint[:12]} != {self.fingerprint()[:12]}; {self.describe()})"
            )
        if next_step < 0 or consumed < 0:
            raise DataError(f"data state has a negative position: next_step={next_step}, samples={consumed}")
        if state.get("global_batch") != self.global_batch:
            log.info(
                "resuming data at sample %d with global batch %d (was %s)",
                consumed, self.global_batch, state.get("global_batch"),
            )
        self._base_step = self._next_step = next_step
        self._base_sample = consumed

    def describe(self) -> str:
        return f"{self.kind} data, seed {self.seed}, seq_len {self.seq_len}"


class SyntheticSource(DataSource):
    """The noisy affine recurrence of the module docstring."""

    kind = "synthetic"

    def __init__(self, seed: int, seq_len: int, vocab: int, global_batch: int,
                 noise: float = SYNTHETIC_NOISE) -> None:
        super().__init__(seed, seq_len, vocab, global_batch)
        if not 0.0 <= noise <= 1.0:
            raise DataError(f"synthetic noise must be in [0, 1], got {noise}")
        self.noise = noise
        rule = _generator(self.seed, 0x5EED)
        self.b = int(torch.randint(0, vocab, (1,), generator=rule))
        # The multiplier must be coprime with V so that the rule is a permutation of the vocabulary.
        candidates = [a for a in range(1, max(vocab, 2)) if math.gcd(a, vocab) == 1] or [1]
        self.a = candidates[int(torch.randint(0, len(candidates), (1,), generator=rule))]

    def fingerprint(self) -> str:
        text = f"synthetic-affine-v1 vocab={self.vocab} seq_len={self.seq_len} noise={self.noise}"
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        return f"{super().describe()}, rule x -> ({self.a} x + {self.b}) mod {self.vocab}, noise {self.noise}"

    def _samples(self, indices: list[int]) -> torch.Tensor:
        n, length, vocab = len(indices), self.seq_len + 1, self.vocab
        start = torch.empty(n, dtype=torch.int64)
        is_noise = torch.empty(n, length, dtype=torch.bool)
        noise_tok = torch.empty(n, length, dtype=torch.int64)
        for row, g in enumerate(indices):
            gen = _generator(self.seed, g)
            start[row] = torch.randint(0, vocab, (1,), generator=gen)
            is_noise[row] = torch.rand(length, generator=gen) < self.noise
            noise_tok[row] = torch.randint(0, vocab, (length,), generator=gen)
        out = torch.empty(n, length, dtype=torch.int64)
        out[:, 0] = start
        for t in range(1, length):
            rule = (self.a * out[:, t - 1] + self.b) % vocab  # (n,)
            out[:, t] = torch.where(is_noise[:, t], noise_tok[:, t], rule)
        return out


class TokenFileSource(DataSource):
    """Windows of memory-mapped token files (training.data.token_files: one file or a folder of shards,
    uint16 or uint32), a seeded permutation of all windows per epoch."""

    kind = "tokens"
    _FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of a file: cheap identity for big files

    def __init__(self, path: str, seed: int, seq_len: int, vocab: int, global_batch: int,
                 dtype: str = "uint16", holdout: float = 0.0, root: str | None = None,
                 field: str = "data.path") -> None:
        super().__init__(seed, seq_len, vocab, global_batch)
        self.path, self.dtype, self.holdout = os.fspath(path), dtype, holdout
        try:
            self.files = token_files(self.path)
        except TokenFileError as e:
            raise DataError(str(e)) from e
        self._mmaps: list[mmap.mmap | None] = []
        self._shards: list[torch.Tensor] = []
        counts = []
        for f in self.files:  # checked as opened (with root: inside the data root; training.data.confined)
            try:
                with open_confined(f, root, field) as fh:
                    n = tokens_in(f, os.fstat(fh.fileno()).st_size, dtype)
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if n else None
            except (ConfinedPathError, TokenFileError) as e:
                raise DataError(str(e)) from e
            except OSError as e:
                raise DataError(f"{field} {f!r} cannot be read") from e  # no OS error text: no oracle
            counts.append(n)
            self._mmaps.append(m)
            self._shards.append(_token_view(m, dtype))
        self.n_tokens = sum(counts)
        windows = windows_per_shard(counts, seq_len)
        self._first_window = list(itertools.accumulate(windows, initial=0))  # of each shard
        self.n_windows = self._first_window[-1]
        if self.n_windows < 1:
            raise DataError(
                f"data.path {self.path!r} holds {self.n_tokens} tokens; "
                f"at least seq_len + 1 = {seq_len + 1} are needed in one file"
            )
        # data.validation.fraction: the last windows are held out, never trained on (data/validation.py).
        self.n_heldout = math.ceil(holdout * self.n_windows) if holdout > 0 else 0
        if self.n_heldout >= self.n_windows:
            raise DataError(f"data.validation.fraction ({holdout}) leaves none of the {self.n_windows} "
                            f"windows of data.path {self.path!r} for training")
        self.n_windows -= self.n_heldout  # training windows: [0, n_windows)
        self._perms: dict[int, torch.Tensor] = {}
        self._fingerprint: str | None = None

    @property
    def memory_mapped(self) -> bool:
        """The tokens are read through memory maps of the files, not loaded into memory."""
        return all(isinstance(m, mmap.mmap) for m in self._mmaps if m is not None)

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            span = self._FINGERPRINT_SPAN
            if len(self.files) == 1 and self.dtype == "uint16":  # the format of a single nanoGPT file
                h = hashlib.sha256(f"tokens-uint16-v1 n={self.n_tokens} seq_len={self.seq_len}".encode())
            else:
                names = [os.path.basename(f) for f in self.files]
                h = hashlib.sha256(f"tokens-{self.dtype}-v2 files={names} seq_len={self.seq_len}".encode())
            if self.n_heldout:
                h.update(f"heldout={self.n_heldout}".encode())
            for m in self._mmaps:
                if m is not None:
                    h.update(m[:span])
                    h.update(m[max(0, len(m) - span):])
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def describe(self) -> str:
        files = f"{len(self.files)} {self.dtype} files" if len(self.files) > 1 else self.dtype
        counts = f"{self.n_tokens} tokens, {self.n_windows} windows"
        return f"{super().describe()}, {self.path} ({files}, {counts})"

    def epoch_of(self, sample: int) -> int:
        return sample // self.n_windows

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = self._perms.get(epoch)
        if perm is None:
            # O(n_windows) int64 memory per epoch; two epochs are cached (a batch may span a boundary).
            perm = torch.randperm(self.n_windows, generator=_generator(self.seed, 0xE90C, epoch))
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def window_of(self, sample: int) -> int:
        """Global index k of the window read as sample g (shard by shard, in file order)."""
        return int(self._permutation(self.epoch_of(sample))[sample % self.n_windows])

    def window_tokens(self, window: int) -> torch.Tensor:
        """(seq_len + 1,) int64 tokens of global window `window`."""
        shard = bisect.bisect_right(self._first_window, window) - 1
        offset = (window - self._first_window[shard]) * self.seq_len
        return self._shards[shard][offset: offset + self.seq_len + 1].to(torch.int64) & _ID_MASK[self.dtype]

    def _samples(self, indices: list[int]) -> torch.Tensor:
        out = torch.empty(len(indices), self.seq_len + 1, dtype=torch.int64)
        for row, g in enumerate(indices):
            out[row] = self.window_tokens(self.window_of(g))
        if out.numel() and int(out.max()) >= self.vocab:
            # Name the position, never the value: the message must not echo the file's bytes.
            row, col = (int(i) for i in (out >= self.vocab).nonzero()[0])
            window = self.window_of(indices[row])
            shard = bisect.bisect_right(self._first_window, window) - 1
            offset = (window - self._first_window[shard]) * self.seq_len + col
            raise DataError(
                f"data.path {self.path!r}: the token at offset {offset} of "
                f"{os.path.basename(self.files[shard])!r} is >= model.vocab ({self.vocab}); "
                f"check the file with `lattice data check {self.path} --vocab {self.vocab}`"
            )
        return out


_ID_MASK = {"uint16": 0xFFFF, "uint32": 0xFFFFFFFF}


def _token_view(buffer: mmap.mmap | None, dtype: str) -> torch.Tensor:
    """(n_tokens,) view of a mapped file, no copy; uint32 is read as int32 and masked on use."""
    if buffer is None:
        return torch.empty(0, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
        return torch.frombuffer(buffer, dtype=torch.uint16 if dtype == "uint16" else torch.int32)


def make_data_source(cfg: DataConfig, model: ModelSpec, global_batch: int) -> DataSource:
    """The data source a run's config names, producing (B, model.seq_len) batches."""
    if cfg.kind == "synthetic":
        return SyntheticSource(cfg.seed, model.seq_len, model.vocab, global_batch)
    if cfg.kind == "tokens":
        if not cfg.path:
            raise DataError("data.path is required when data.kind is 'tokens'")
        val = cfg.validation
        return TokenFileSource(cfg.path, cfg.seed, model.seq_len, model.vocab, global_batch,
                               dtype=cfg.dtype, holdout=(val.fraction or 0.0) if val is not None else 0.0,
                               root=cfg.root)
    raise DataError(f"data.kind must be 'synthetic' or 'tokens', got {cfg.kind!r}")


def write_token_file(path: str | os.PathLike[str], tokens: Any, dtype: str = "uint16") -> int:
    """Write token ids (a tensor, numpy array or sequence of ints) as a flat little-endian
    `dtype` file (uint16: nanoGPT's format); returns the number of tokens. For tests and demos."""
    if sys.byteorder != "little":  # token files are little-endian
        raise DataError("write_token_file supports little-endian hosts only")
    if dtype not in _ID_MASK:
        raise DataError(f"dtype must be one of {sorted(_ID_MASK)}, got {dtype!r}")
    if hasattr(tokens, "astype"):  # numpy array: avoid relying on torch's numpy unsigned bridge
        tokens = tokens.astype("int64").tolist()
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    top = _ID_MASK[dtype]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) > top):
        raise DataError(f"token ids must be in [0, {top}], got range [{int(t.min())}, {int(t.max())}]")
    if dtype == "uint16":
        data, width = t.to(torch.int32).to(torch.uint16).contiguous(), 2  # (n,)
    else:
        data, width = torch.where(t > 0x7FFFFFFF, t - (1 << 32), t).to(torch.int32).contiguous(), 4
    with open(path, "wb") as f:
        f.write(ctypes.string_at(data.data_ptr(), width * data.numel()))
    return int(t.numel())
