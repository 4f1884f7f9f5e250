"""API token requests and responses."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    Field,
)

if TYPE_CHECKING:
    pass
from service.schemas.common import StrictModel

MAX_TTL_S = 10 * 366 * 86400


class TokenCreate(StrictModel):
    tenant: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Tenant the token acts for (created if new).",
        examples=["team-a"],
    )
    admin: bool = Field(False, description="Admin tokens see every tenant and may create tokens.")
    description: str | None = Field(
        None, max_length=200, pattern=r"^[^\x00]*$", description="Free-text label."
    )
    ttl_s: int | None = Field(
        None,
        ge=60,
        le=MAX_TTL_S,
        description="Seconds until the token expires (60 s to 10 years); unset = it never expires.",
        examples=[30 * 86400],
    )


class TokenCreated(BaseModel):
    token: str = Field(description="The bearer token; shown only now, only its hash is stored.")
    tenant: str
    role: Literal["admin", "user"]
    id: int | None = Field(None, description="The token's id (for `GET/DELETE /v1/tokens`).")
    expires_at: dt.datetime | None = Field(None, description="When it stops working; null = never.")
