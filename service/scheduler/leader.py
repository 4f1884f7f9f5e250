"""Leader election for the scheduler on the database: exactly one scheduler process acts at a time.

Every scheduler process (role `scheduler` or `all`) runs a `LeaderElector`. The leader renews the
lease row (service.store.leases) every `renew_s`; the others watch it hot, every `renew_s / 2`,
and take it over by compare-and-set on the term once they have seen no renewal for `lease_s` of
their own monotonic clock (no trust in another machine's clock). With the defaults (renew 2 s,
lease 6 s) a SIGKILLed leader is replaced within about 8 s. A leader that cannot renew for
`lease_s` stops acting on its own, before anyone else may take over; a leader that finds the row
taken steps down at once. The term is the fence: the scheduler's writing sessions come from
`fenced_session_factory`, so a deposed leader's late write is refused (NotLeader) even if it has
not noticed yet.

On SQLite (one machine) a holder on this host whose pid is gone is taken over at once: a
`lattice serve` restarted after a SIGKILL does not wait for the lease to run out.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service import metrics
from service.errors import NotLeader
from service.store.db import make_session_factory, session_scope
from service.store.leases import (
    SCHEDULER_LEASE,
    Fence,
    fenced_session_factory,
    read_lease,
    release_lease,
    renew_lease,
    take_lease,
)

log = logging.getLogger(__name__)


def process_identity() -> str:
    """How a lease names its holder: 'host:pid'."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_gone_here(holder: str) -> bool:
    """True if `holder` ('host:pid') names a process on this host that no longer exists."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it exists (another user's process)
    return False


class LeaderElector:
    """Takes and keeps the lease; `acting_term()` is the term to act in (None: do not act)."""

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = SCHEDULER_LEASE,
        holder: str | None = None,
        lease_s: float = 6.0,
        renew_s: float = 2.0,
        reap_dead_local_holder: bool = False,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        if not 0 < renew_s < lease_s:
            raise ValueError(f"renew_s ({renew_s}) must be positive and below lease_s ({lease_s})")
        self.name = name
        self.holder = holder or process_identity()
        self.lease_s, self.renew_s = lease_s, renew_s
        self.fence = Fence(name, self.holder)
        self._sf: sessionmaker[Session] = make_session_factory(engine)
        self._rsf: sessionmaker[Session] = make_session_factory(engine, read_only=True)
        self._reap_local = reap_dead_local_holder
        self.on_change = on_change  # called (in the elector thread) when the term changes
        self._seen: tuple[str | None, int, dt.datetime] | None = None  # the row as last seen changing
        self._seen_at = 0.0  # monotonic time it was first seen so
        self._renewed_at = 0.0  # monotonic time of the start of our last successful renewal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def session_factory(self, engine: Engine) -> sessionmaker[Session]:
        """Writing sessions fenced by this elector's term."""
        return fenced_session_factory(engine, self.fence)

    # ---- what the scheduler asks ----------------------------------------------------------------
    @property
    def term(self) -> int | None:
        return self.fence.term

    def acting_term(self) -> int | None:
        """The term while this process holds a lease it renewed less than `lease_s` ago."""
        term = self.fence.term
        if term is None or time.monotonic() - self._renewed_at >= self.lease_s:
            return None
        return term

    # ---- one round -------------------------------------------------------------------------------
    def step(self) -> int | None:
        """Renew (leader) or try to take the lease (follower); returns the acting term."""
        with self._lock:
            before = self.fence.term
            try:
                if before is not None:
                    self._renew(before)
                else:
                    self._try_take()
            except SQLAlchemyError as e:
                log.warning("leader lease %s: database error: %s", self.name, str(e).splitlines()[0])
                if before is not None and time.monotonic() - self._renewed_at >= self.lease_s:
                    self._lose(f"could not renew the lease for {self.lease_s:g} s")
            changed = self.fence.term != before
        if changed and self.on_change is not None:
            self.on_change()
        return self.acting_term()

    def _try_take(self) -> None:
        started = time.monotonic()
        with self._rsf() as s:  # watching takes no write lock (SQLite); the take below is a compare-and-set
            view = read_lease(s, self.name)
        if view is not None:
            key = (view.holder, view.term, view.renewed_at)
            if key != self._seen:
                self._seen, self._seen_at = key, started
            free = view.holder is None or view.holder == self.holder
            expired = started - self._seen_at >= self.lease_s
            dead = self._reap_local and view.holder is not None and _pid_gone_here(view.holder)
            if not (free or expired or dead):
                return
        with session_scope(self._sf) as s:
            term = take_lease(s, self.name, self.holder, seen=view, lease_s=self.lease_s)
        if term is None:
            return
        self.fence.term, self._renewed_at = term, started
        previous = f" from {view.holder} (term {view.term})" if view is not None and view.holder else ""
        log.info("leader lease %s: %s took it in term %d%s", self.name, self.holder, term, previous)

    def _renew(self, term: int) -> None:
        started = time.monotonic()
        with session_scope(self._sf) as s:
            ok = renew_lease(s, self.name, self.holder, term, lease_s=self.lease_s)
        if ok:
            self._renewed_at = started
        else:
            self._lose(f"another process took the lease after term {term}")

    def _lose(self, why: str) -> None:
        log.warning("leader lease %s: %s steps down (%s)", self.name, self.holder, why)
        self.fence.term = None

    def step_down(self, why: str) -> None:
        """Stop acting now (the scheduler hit the fence); the next round may take the lease again
        only once it is free or runs out."""
        with self._lock:
            if self.fence.term is not None:
                self._lose(why)

    # ---- the thread ------------------------------------------------------------------------------
    def start(self) -> None:
        """One synchronous round (an uncontested process is leader when this returns), then a thread."""
        self.step()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"lattice-lease-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(self.renew_s if self.fence.term is not None else self.renew_s / 2)
            if not self._stop.is_set():
                self.step()

    def stop(self, *, release: bool = True) -> None:
        """Stop the thread and (release) hand the lease back so another process takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        with self._lock:
            term, self.fence.term = self.fence.term, None
        if release and term is not None:
            try:
                with session_scope(self._sf) as s:
                    release_lease(s, self.name, self.holder, term)
                log.info("leader lease %s: %s released it (term %d)", self.name, self.holder, term)
            except SQLAlchemyError as e:
                log.warning("leader lease %s: could not release it: %s", self.name, e)


class Leadership:
    """The scheduler's side of the election: whether it acts now. A new term calls `on_elected`
    (re-attach: reconcile) before the first tick; losing the lease, or a write refused by the fence,
    calls `on_deposed` (forget the attached controllers: they are detached and keep running for the
    next leader). Without an elector the process always acts (one scheduler, the tests)."""

    def __init__(self, elector: LeaderElector | None, *, on_elected: Callable[[], None],
                 on_deposed: Callable[[], None]) -> None:
        self.elector = elector
        self.acting_term: int | None = None
        self._on_elected, self._on_deposed = on_elected, on_deposed

    @property
    def is_leader(self) -> bool:
        return self.elector is None or self.acting_term is not None

    def may_act(self) -> bool:
        if self.elector is None:
            return True
        term = self.elector.acting_term()
        if term is None:
            if self.acting_term is not None:
                self.step_down("the lease was lost")
            return False
        if term != self.acting_term:
            started = time.monotonic()
            try:
                self._on_elected()  # another error propagates: the next iteration tries again
            except NotLeader as e:
                self.step_down(str(e))
                return False
            self.acting_term = term
            metrics.SCHEDULER_LEADER.set(1)
            log.info("scheduler leader in term %d (%s): re-attached in %.2f s", term, self.elector.holder,
                     time.monotonic() - started)
        return True

    def step_down(self, why: str) -> None:
        log.warning("scheduler steps down: %s", why)
        if self.elector is not None:
            self.elector.step_down(why)
        self.acting_term = None
        metrics.SCHEDULER_LEADER.set(0)
        self._on_deposed()

    def stop(self) -> None:
        """Stop the elector and release the lease (the loop has written its last)."""
        if self.elector is not None:
            self.elector.stop(release=True)
        self.acting_term = None
        metrics.SCHEDULER_LEADER.set(0)
