"""/v1/jobs/{id}/logs: each rank's output, per attempt, as plain text (workers.logs writes the files).

The files are in the job's folder (`<checkpoint_root>/<job_id>/logs/attempt-<k>/rank-<r>.log`), so
they outlive the job and the service. Paths are built from the job id the store returned and from
validated integers only. `follow=true` streams what is appended until the job is terminal; following
the latest attempt moves on to the next one when the ranks restart (with a `==> attempt k <==` line).
Another tenant's job is a 404, as for `GET /v1/jobs/{id}`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.orm import sessionmaker

from service.api import operations
from service.api.deps import CurrentPrincipal, ReadSessionDep, SettingsDep
from service.api.problems import problem_responses
from service.api.responses import ModelResponseRoute
from service.api.routes.jobs import JobId
from service.errors import NotFound
from service.schemas.logs import AttemptLogsPublic, LogIndex, RankLogPublic
from service.settings import Settings
from service.store.models import Job, JobState
from workers.logs import (
    LogFollower,
    iter_log,
    job_logs_dir,
    log_index,
    log_parts,
    log_size,
    ranges,
    rank_log_path,
    tail_log,
)

router = APIRouter(prefix="/v1/jobs", tags=["logs"], route_class=ModelResponseRoute)

FOLLOW_POLL_S = 0.5
TEXT = "text/plain; charset=utf-8"


def logs_dir_of(settings: Settings, job: Job) -> Path:
    assert settings.checkpoint_root is not None
    return job_logs_dir(settings.checkpoint_root / job.id)




@router.get(
    "/{job_id}/logs/index",
    response_model=LogIndex,
    summary="Which attempts and ranks of a job have logs",
    responses=problem_responses(401, 404, 422),
)
def get_log_index(
    job_id: JobId, session: ReadSessionDep, principal: CurrentPrincipal, settings: SettingsDep
) -> LogIndex:
    job = operations.visible_job(session, principal, job_id)
    logs_dir = logs_dir_of(settings, job)
    index = log_index(logs_dir)
    attempts = [
        AttemptLogsPublic(attempt=a, ranks=[
            RankLogPublic(rank=r, bytes=log_size(rank_log_path(logs_dir, a, r))) for r in ranks
        ])
        for a, ranks in index.items()
    ]
    return LogIndex(job_id=job.id, state=str(job.state), latest=max(index, default=None), attempts=attempts)


@router.get(
    "/{job_id}/logs",
    response_class=StreamingResponse,
    summary="A rank's output (stdout, stderr, logging) in one attempt, as plain text",
    description="Rank 0 of the latest attempt unless `rank`/`attempt` say otherwise; `tail` keeps the "
    "last lines. `follow=true` streams what the rank writes until the job is terminal (chunked). "
    "The response names what it shows in `X-Lattice-Log-Rank` and `X-Lattice-Log-Attempt`; "
    "`/logs/index` lists what exists.",
    responses={200: {"content": {"text/plain": {}}, "description": "The log."},
               **problem_responses(401, 404, 422)},
)
def get_logs(
    job_id: JobId,
    request: Request,
    session: ReadSessionDep,
    principal: CurrentPrincipal,
    settings: SettingsDep,
    rank: Annotated[int, Query(ge=0, le=1_000_000, description="Rank.")] = 0,
    attempt: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="Attempt (1-based); default the latest.")
    ] = None,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Only the last lines.")] = None,
    follow: Annotated[bool, Query(description="Stream until the job is terminal.")] = False,
) -> Response:
    job = operations.visible_job(session, principal, job_id)
    terminal = JobState(job.state).terminal
    logs_dir = logs_dir_of(settings, job)
    index = log_index(logs_dir)
    chosen = _choose(job, index, rank, attempt, waiting=follow and not terminal)
    headers = {"X-Lattice-Log-Rank": str(rank), "X-Lattice-Log-Attempt": str(chosen or "")}
    if follow and not terminal:
        found_id = job.id
        session.rollback()  # no read transaction is held while the stream lasts
        sf = request.app.state.read_session_factory
        stream = _follow(request, sf, found_id, logs_dir, rank, chosen, latest=attempt is None, tail=tail)
        return StreamingResponse(stream, media_type=TEXT, headers=headers)
    assert chosen is not None
    path = rank_log_path(logs_dir, chosen, rank)
    if tail is not None:
        return Response(tail_log(path, tail), media_type=TEXT, headers=headers)
    return StreamingResponse(iter_log(path), media_type=TEXT, headers=headers)


def _choose(
    job: Job, index: dict[int, list[int]], rank: int, attempt: int | None, *, waiting: bool
) -> int | None:
    """The attempt to show (None: none yet, and the caller waits for it), or NotFound saying what exists."""
    if attempt is None and not index:
        if waiting:
            return None
        raise NotFound(f"job {job.id!r} has no logs yet (state {job.state}): its ranks write them once "
                       "they start")
    chosen = attempt if attempt is not None else max(index)
    if chosen not in index:
        raise NotFound(f"job {job.id!r} has no logs for attempt {chosen}; attempts with logs: "
                       f"{ranges(sorted(index))}")
    if rank not in index[chosen] and not waiting:
        raise NotFound(f"rank {rank} has no log in attempt {chosen} of job {job.id!r}; ranks with logs: "
                       f"{ranges(index[chosen])}")
    return chosen


def _is_terminal(sf: sessionmaker, job_id: str) -> bool:
    with sf() as s:
        job = s.get(Job, job_id)
        return job is None or JobState(job.state).terminal


def _start_following(path: Path, tail: int | None) -> tuple[LogFollower, Iterator[bytes]]:
    """A follower of `path` and what to show before it follows: the last `tail` lines up to where
    it starts, or else the older rotated parts (the follower reads the newest part from its start)."""
    if tail is None:
        return LogFollower(path), (chunk for part in log_parts(path)[:-1] for chunk in iter_log(part))
    try:
        end = path.stat().st_size
    except OSError:
        end = 0
    return LogFollower(path, start=end), iter([tail_log(path, tail, end=end)])


async def _follow(
    request: Request, sf: sessionmaker, job_id: str, logs_dir: Path, rank: int, attempt: int | None, *,
    latest: bool, tail: int | None,
) -> AsyncIterator[bytes]:
    """Stream rank `rank`'s log of `attempt` (with `latest`: of the newest attempt, moving on as new
    ones start) until the job is terminal or the client goes away."""
    follower: LogFollower | None = None
    try:
        while True:
            target = max(log_index(logs_dir), default=None) if latest else attempt
            if target is not None and (follower is None or target != attempt):
                path = rank_log_path(logs_dir, target, rank)
                if follower is None:
                    follower, initial = _start_following(path, tail)
                    for chunk in initial:
                        yield chunk
                else:  # the ranks restarted: finish the old attempt's file, then the new one
                    while rest := follower.read_new():
                        yield rest
                    follower.close()
                    follower = LogFollower(path)
                    yield f"\n==> attempt {target} <==\n".encode()
                attempt = target
            data = follower.read_new() if follower is not None else b""
            if data:
                yield data
                continue
            if await request.is_disconnected():
                return
            if await run_in_threadpool(_is_terminal, sf, job_id):
                while follower is not None and (rest := follower.read_new()):
                    yield rest
                return
            await asyncio.sleep(FOLLOW_POLL_S)
    finally:
        if follower is not None:
            follower.close()
