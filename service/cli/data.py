"""`lattice data check PATH --vocab V`: what a token file (or a folder of shards) holds, and whether
its ids fit the model's vocabulary. Local and torch-free (training.data.token_files)."""

from __future__ import annotations

from typing import Annotated

import typer

from service.cli.app import one_line_errors, out
from service.cli.client import CliError


@one_line_errors
def data_check(
    path: Annotated[str, typer.Argument(help="A token file, or a folder of *.bin shards (name order).")],
    vocab: Annotated[int, typer.Option(help="The model's vocabulary size (model.vocab).")],
    dtype: Annotated[str, typer.Option(help="Token width: uint16 (nanoGPT's .bin) or uint32.")] = "uint16",
    seq_len: Annotated[int, typer.Option(help="Tokens per sample (model.seq_len), to count samples.")] = 1024,
) -> None:
    """Count tokens and samples, find the largest token id, and check it fits the vocabulary
    (exit code 1 when it does not)."""
    from training.data.token_files import TokenFileError, inspect_tokens

    try:
        report = inspect_tokens(path, vocab=vocab, seq_len=seq_len, dtype=dtype)
    except TokenFileError as e:
        raise CliError(str(e).replace("data.dtype", "--dtype").replace("data.path", "PATH")) from e
    except OSError as e:
        raise CliError(f"PATH {path!r} cannot be read: {e}") from e
    out.print(f"files    {report.files} ({report.dtype})")
    out.print(f"tokens   {report.tokens}")
    out.print(f"samples  {report.samples} (windows of seq_len + 1 = {seq_len + 1} tokens)")
    out.print(f"max id   {report.max_id}")
    if not report.fits:
        raise CliError(f"fits     no: token id {report.max_id} is beyond the vocabulary (ids < {vocab})")
    out.print(f"fits     yes (vocab {vocab})")
