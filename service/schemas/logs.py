"""What `GET /v1/jobs/{id}/logs/index` says exists: the attempts of a job and the ranks with a log in each."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RankLogPublic(BaseModel):
    rank: int = Field(ge=0, description="Rank whose output this is.")
    bytes: int = Field(ge=0, description="Size of its log, rotated parts included.")


class AttemptLogsPublic(BaseModel):
    attempt: int = Field(ge=1, description="The k-th start of the job's ranks (1-based).")
    ranks: list[RankLogPublic]


class LogIndex(BaseModel):
    job_id: str
    state: str = Field(description="The job's state now (a terminal job's logs no longer grow).")
    latest: int | None = Field(description="The newest attempt with logs (what /logs shows); null: none yet.")
    attempts: list[AttemptLogsPublic]
