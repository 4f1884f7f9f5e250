"""Token files on disk (torch-free, so the CLI and the service can check them without torch).

A token source is either one file or a folder of shards read in the order of their sorted names
(``*.bin``; other files are ignored). Every file is a flat array of little-endian unsigned token
ids: ``uint16`` (nanoGPT's ``.bin``, vocabularies up to 65,536) or ``uint32`` (larger ones, e.g.
the llama3 presets' 128,256 tokens). Samples are windows of ``seq_len + 1`` tokens at offsets
``k * seq_len`` inside one shard (a window never spans two shards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKEN_DTYPES = {"uint16": 2, "uint32": 4}  # dtype name -> bytes per token
SHARD_SUFFIX = ".bin"
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning for the largest id


class TokenFileError(ValueError):
    """A token path that cannot be read as the given dtype; the message names the path and the fix."""


def check_dtype(dtype: str) -> int:
    """Bytes per token of `dtype`, or a TokenFileError naming the allowed values."""
    if dtype not in TOKEN_DTYPES:
        raise TokenFileError(f"data.dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    return TOKEN_DTYPES[dtype]


def token_files(path: str | os.PathLike[str]) -> list[str]:
    """The files of a token source: the file itself, or a folder's ``*.bin`` shards in name order."""
    p = Path(path)
    if p.is_dir():
        shards = sorted(str(f) for f in p.iterdir() if f.suffix == SHARD_SUFFIX and f.is_file())
        if not shards:
            raise TokenFileError(f"data.path {str(p)!r} is a folder without {SHARD_SUFFIX} shards")
        return shards
    if not p.is_file():
        raise TokenFileError(f"data.path {str(p)!r} cannot be read: no such token file or folder of shards")
    return [str(p)]


def shard_tokens(files: list[str], dtype: str) -> list[int]:
    """Tokens in each file; a size that is not a multiple of the dtype's width is an error."""
    counts = []
    for f in files:
        try:
            size = os.path.getsize(f)
        except OSError as e:
            raise TokenFileError(f"data.path {f!r} cannot be read: {e}") from e
        counts.append(tokens_in(f, size, dtype))
    return counts


def tokens_in(f: str, size: int, dtype: str) -> int:
    """Tokens in a file of `size` bytes; a size that is not a multiple of the dtype's width is an error."""
    width = check_dtype(dtype)
    if size % width:
        raise TokenFileError(
            f"data.path {f!r} has {size} bytes; a {dtype} token file has a size that is a multiple "
            f"of {width}{' (an even size)' if width == 2 else ''} (set data.dtype to the file's width)"
        )
    return size // width


def windows_per_shard(counts: list[int], seq_len: int) -> list[int]:
    """Non-overlapping windows of seq_len + 1 tokens (stride seq_len) each shard holds."""
    return [(n - 1) // seq_len if n > 0 else 0 for n in counts]


@dataclass(frozen=True)
class TokenReport:
    """What `lattice data check` prints."""

    files: int
    tokens: int
    samples: int  # windows of seq_len + 1 tokens
    max_id: int
    vocab: int
    dtype: str

    @property
    def fits(self) -> bool:
        return self.max_id < self.vocab


def inspect_tokens(path: str | os.PathLike[str], vocab: int, seq_len: int, dtype: str = "uint16"
                   ) -> TokenReport:
    """Count tokens and samples and find the largest id (a full scan, in chunks)."""
    if vocab < 1 or seq_len < 1:
        raise TokenFileError(f"vocab and seq_len must be >= 1, got vocab={vocab}, seq_len={seq_len}")
    files = token_files(path)
    counts = shard_tokens(files, dtype)
    largest = -1
    for f, n in zip(files, counts, strict=True):
        if n == 0:
            continue
        data = np.memmap(f, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(n,))
        for start in range(0, n, _SCAN_CHUNK):
            largest = max(largest, int(data[start:start + _SCAN_CHUNK].max()))
        del data
    return TokenReport(files=len(files), tokens=sum(counts),
                       samples=sum(windows_per_shard(counts, seq_len)),
                       max_id=largest, vocab=vocab, dtype=dtype)
