"""Provision the token Prometheus sends to the API's /metrics (docker-compose service `metrics-token`).

    python deploy/metrics_token.py /run/lattice-metrics/token

Writes a fresh random token to the file unless it already holds one (so restarts keep it; delete
the file, or the compose volume `metrics-token`, to rotate it). The API reads the file as
LATTICE_METRICS_TOKEN_FILE and Prometheus as the scrape job's `authorization.credentials_file`;
both re-read it on every scrape. The file is mode 0640 in a 0750 folder: the owner (the API's user)
and the group (Prometheus runs with that group in docker-compose.yml) read it, nobody else.
Standard library only, like deploy/wait_for_db.py.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

FILE_MODE = 0o640
DIR_MODE = 0o750
TOKEN_BYTES = 32


def existing_token(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text.splitlines()[0].strip() if text else None


def provision(path: Path) -> bool:
    """Make `path` hold a token with the right modes; True if a new token was written."""
    path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path.parent, DIR_MODE)
    created = existing_token(path) is None
    if created:
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(TOKEN_BYTES) + "\n")
        os.replace(tmp, path)  # never a half-written token for a concurrent reader
    os.chmod(path, FILE_MODE)
    return created


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} <token file>", file=sys.stderr)
        return 2
    path = Path(argv[1])
    try:
        created = provision(path)
    except OSError as e:
        print(f"metrics token: cannot write {path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"metrics token: {'created' if created else 'kept the existing'} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
