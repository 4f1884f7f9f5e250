"""Typed dependencies of the routes: the session, the settings, the caller, the scheduler seam.

A dependency that does no blocking I/O is `async def`: FastAPI runs it on the event loop instead of
handing it to a worker thread (each hop is a wait for a thread when the API is busy, a GIL hand-off and
an event-loop wake-up). Those that touch the database (the sessions, the token lookup) stay sync."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Protocol

import anyio
import anyio.to_thread
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session, sessionmaker

from service.auth import ANONYMOUS_ADMIN, Principal, authenticate_in, authenticate_request
from service.errors import Forbidden, Unauthorized
from service.settings import Settings
from service.store.db import read_phase


class SchedulerHook(Protocol):
    """What the API needs from the scheduler (app.state.scheduler; None when there is none)."""

    def wake(self) -> None:
        """Something changed (a submit, a cancel): run a scheduling pass soon."""

    def cancel(self, job_id: str) -> None:
        """Stop the running job's ranks; its state is already `cancelled` in the store."""


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


@asynccontextmanager
async def _session_from(factory: sessionmaker[Session]) -> AsyncIterator[Session]:
    # Making a session does no I/O (it connects on first use), so it happens on the event loop; closing
    # one that began a transaction returns its connection to the pool (a rollback: I/O), in a thread.
    session = factory()
    try:
        yield session
    finally:
        if session.in_transaction():
            with anyio.CancelScope(shield=True):  # a client that went away must not leak the connection
                await anyio.to_thread.run_sync(session.close)
        else:
            session.close()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for a route that writes: it commits explicitly, anything else rolls back.
    Its transaction begins (and on SQLite takes the write lock) only when the route body uses it."""
    async with _session_from(request.app.state.session_factory) as session:
        yield session


async def get_read_session(request: Request) -> AsyncIterator[Session]:
    """A session for a route that only reads (never takes SQLite's write lock)."""
    async with _session_from(request.app.state.read_session_factory) as session:
        yield session


async def get_scheduler(request: Request) -> SchedulerHook | None:
    return getattr(request.app.state, "scheduler", None)


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
SchedulerDep = Annotated[SchedulerHook | None, Depends(get_scheduler)]

_bearer = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer lat_...`.")


BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def get_principal(request: Request, settings: SettingsDep, credentials: BearerDep) -> Principal:
    if not settings.auth_enabled:
        return ANONYMOUS_ADMIN
    return principal_for_token(request, _bearer_token(credentials))


def get_reader(
    request: Request, settings: SettingsDep, credentials: BearerDep, session: ReadSessionDep
) -> Principal:
    """The caller of a route that only reads, looked up in the route's own read session (FastAPI
    hands both the same one per request): the token and the route's read are one transaction."""
    if not settings.auth_enabled:
        return ANONYMOUS_ADMIN
    return authenticate_in(session, request.app.state.session_factory, _bearer_token(credentials))


def get_submitter(
    request: Request, settings: SettingsDep, credentials: BearerDep, session: SessionDep
) -> Principal:
    """The caller of a route that reads before it writes (a submit), looked up in the route's own
    session as the first statement of its read transaction (service.store.db.read_phase: on SQLite a
    deferred BEGIN, no write lock), which the route's own lookups continue and then end before it
    writes: one read transaction for the token and the lookups, not one each."""
    if settings.auth_enabled:
        read_phase(session)
    return get_reader(request, settings, credentials, session)


def _bearer_token(credentials: HTTPAuthorizationCredentials | None) -> str:
    if credentials is None or not credentials.credentials:
        raise Unauthorized("missing bearer token: send the header 'Authorization: Bearer <token>'")
    return credentials.credentials


def principal_for_token(request: Request, token: str) -> Principal:
    # Its own short transactions, over before the route runs (no lock held across threads); the
    # write lock only when the token's last use needs recording (at most once a minute).
    state = request.app.state
    return authenticate_request(state.read_session_factory, state.session_factory, token)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
ReaderPrincipal = Annotated[Principal, Depends(get_reader)]  # for a route whose session is ReadSessionDep
SubmitterPrincipal = Annotated[Principal, Depends(get_submitter)]  # a SessionDep route: reads, then writes


async def require_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this operation needs an admin token")
    return principal


AdminPrincipal = Annotated[Principal, Depends(require_admin)]
