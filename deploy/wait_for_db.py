"""Wait until the database in LATTICE_DATABASE_URL accepts a connection and answers `SELECT 1`.

Used by deploy/migrate.sh before `alembic upgrade head`: in docker-compose and on Kubernetes the
database may still be starting when the one-off migration runs. Exits 0 once the database answers,
1 when the deadline passes (the last error is logged), 2 when no URL is configured.

    python deploy/wait_for_db.py [--timeout SECONDS] [--interval SECONDS] [--url URL]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

log = logging.getLogger("lattice.wait_for_db")


def wait_for_db(url: str, timeout_s: float, interval_s: float) -> bool:
    """Try to connect every `interval_s` until `timeout_s` has passed; True once `SELECT 1` succeeds."""
    engine = create_engine(url, pool_pre_ping=False, connect_args=_connect_args(url))
    deadline = time.monotonic() + timeout_s
    attempt = 0
    try:
        while True:
            attempt += 1
            try:
                with engine.connect() as conn:
                    conn.execute(text("SELECT 1"))
                log.info("database ready after %d attempt(s)", attempt)
                return True
            except SQLAlchemyError as e:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("database not ready after %d attempt(s): %s", attempt, e.__class__.__name__)
                    log.error("last error: %s", str(e).splitlines()[0] if str(e) else repr(e))
                    return False
                log.info("database not ready (attempt %d), retrying in %.1fs", attempt, interval_s)
                time.sleep(min(interval_s, remaining))
    finally:
        engine.dispose()


def _connect_args(url: str) -> dict[str, object]:
    # A bounded connect timeout per attempt, so a black-holed host cannot outlive the deadline.
    return {"connect_timeout": 5} if make_url(url).get_backend_name() == "postgresql" else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("LATTICE_DATABASE_URL", ""),
        help="SQLAlchemy URL (default: $LATTICE_DATABASE_URL)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=float(os.environ.get("LATTICE_DB_WAIT_SECONDS", "60")),
        help="give up after this many seconds (default: $LATTICE_DB_WAIT_SECONDS or 60)",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between attempts (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.url:
        log.error("LATTICE_DATABASE_URL is not set (or pass --url)")
        return 2
    try:
        make_url(args.url)
    except ArgumentError as e:
        log.error("LATTICE_DATABASE_URL is not a valid SQLAlchemy URL: %s", e)
        return 2
    return 0 if wait_for_db(args.url, args.timeout, args.interval) else 1


if __name__ == "__main__":
    sys.exit(main())
