"""Leader lease rows (table `scheduler_leases`): read, take by compare-and-set on the term, renew,
release, and the fence check that a holder's transaction runs first.

The term is the fencing token: it goes up by one whenever the holder changes, and a transaction
opened through `fenced_session_factory` checks (inside the transaction) that the lease still has
the term its process was elected with. On PostgreSQL the check reads the row `FOR SHARE`, so a
takeover (an UPDATE of that row) waits until the fenced transaction ends and every later fenced
transaction of the old holder sees the new term; on SQLite every writing transaction begins with
`BEGIN IMMEDIATE` (service.store.db), which serialises it with the takeover the same way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import Connection, Engine, event, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.errors import NotLeader
from service.store.db import make_session_factory
from service.store.models import SchedulerLease, utcnow

SCHEDULER_LEASE = "scheduler"


@dataclasses.dataclass(frozen=True)
class LeaseView:
    name: str
    holder: str | None
    term: int
    since: dt.datetime
    renewed_at: dt.datetime
    expires_at: dt.datetime

    def current_holder(self, now: dt.datetime | None = None) -> str | None:
        """The holder while its lease runs (by this machine's clock), else None."""
        return self.holder if self.holder and self.expires_at > (now or utcnow()) else None


def read_lease(session: Session, name: str = SCHEDULER_LEASE) -> LeaseView | None:
    row = session.execute(select(SchedulerLease).where(SchedulerLease.name == name)).scalar_one_or_none()
    if row is None:
        return None
    return LeaseView(name=row.name, holder=row.holder, term=row.term, since=row.since,
                     renewed_at=row.renewed_at, expires_at=row.expires_at)


def take_lease(
    session: Session, name: str, holder: str, *, seen: LeaseView | None, lease_s: float
) -> int | None:
    """Become the holder if the lease is still as `seen` (its term and last renewal; None: there is
    no row yet). Returns the new term, or None when another process changed or renewed it first.
    The caller commits."""
    now = utcnow()
    expires = now + dt.timedelta(seconds=lease_s)
    if seen is None:
        try:
            with session.begin_nested():
                session.add(SchedulerLease(name=name, holder=holder, term=1, since=now, renewed_at=now,
                                           expires_at=expires))
        except IntegrityError:
            return None
        return 1
    result = session.execute(
        update(SchedulerLease)
        .where(SchedulerLease.name == name, SchedulerLease.term == seen.term,
               SchedulerLease.renewed_at == seen.renewed_at)
        .values(holder=holder, term=seen.term + 1, since=now, renewed_at=now, expires_at=expires)
        .execution_options(synchronize_session=False)
    )
    return seen.term + 1 if result.rowcount == 1 else None  # type: ignore[attr-defined]


def renew_lease(session: Session, name: str, holder: str, term: int, *, lease_s: float) -> bool:
    """Extend the lease if `holder` still holds it in `term`; False: it was taken over."""
    now = utcnow()
    result = session.execute(
        update(SchedulerLease)
        .where(SchedulerLease.name == name, SchedulerLease.term == term, SchedulerLease.holder == holder)
        .values(renewed_at=now, expires_at=now + dt.timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def release_lease(session: Session, name: str, holder: str, term: int) -> bool:
    """Give the lease up (a clean stop): another process may take it at once. The term stays, so the
    next holder's term is still higher than every term before it."""
    now = utcnow()
    result = session.execute(
        update(SchedulerLease)
        .where(SchedulerLease.name == name, SchedulerLease.term == term, SchedulerLease.holder == holder)
        .values(holder=None, renewed_at=now, expires_at=now)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


class Fence:
    """The term this process holds the lease in (None: not the leader). `check` runs as the first
    statement of every fenced transaction and refuses it with NotLeader unless the lease row still
    names this holder in this term."""

    def __init__(self, name: str, holder: str) -> None:
        self.name = name
        self.holder = holder
        self.term: int | None = None

    def check(self, conn: Connection) -> None:
        term = self.term
        if term is None:
            raise NotLeader(f"{self.holder} is not the {self.name} leader; the write is refused")
        row = conn.execute(
            select(SchedulerLease.term, SchedulerLease.holder)
            .where(SchedulerLease.name == self.name)
            .with_for_update(read=True)  # FOR SHARE on PostgreSQL; SQLite holds the write lock already
        ).first()
        if row is None or row.term != term or row.holder != self.holder:
            now = f"term {row.term} held by {row.holder}" if row is not None else "no lease"
            raise NotLeader(f"{self.holder} was deposed: it was elected in term {term}, the lease is "
                            f"now {now}; the write is refused")


def fenced_session_factory(engine: Engine, fence: Fence) -> sessionmaker[Session]:
    """Writing sessions whose every transaction first checks the fence (NotLeader otherwise)."""
    factory = make_session_factory(engine)

    @event.listens_for(factory, "after_begin")
    def _check_fence(session: Session, transaction: Any, connection: Connection) -> None:
        if transaction.nested:
            return  # a savepoint inside a transaction that was checked when it began
        fence.check(connection)

    return factory
