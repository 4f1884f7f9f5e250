"""API token requests and responses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    Field,
)

if TYPE_CHECKING:
    pass
from service.schemas.common import StrictModel


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


class TokenCreated(BaseModel):
    token: str = Field(description="The bearer token; shown only now, only its hash is stored.")
    tenant: str
    role: Literal["admin", "user"]
