"""Error documents (RFC 9457 problems) and the health probes' answers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    Field,
)

if TYPE_CHECKING:
    pass


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the offending field, e.g. `model.hidden`.")
    message: str = Field(description="What is wrong and what is allowed.")
    location: Literal["body", "query", "path", "header", "cookie"] = "body"


class Problem(BaseModel):
    """An RFC 9457 problem document (media type application/problem+json)."""

    type: str = Field("about:blank", description="URI of the problem type.")
    title: str = Field(description="Short summary of the problem type.")
    status: int = Field(description="HTTP status code.")
    detail: str = Field(description="What went wrong, naming the field and what is allowed.")
    instance: str | None = Field(None, description="The request path.")
    errors: list[FieldError] | None = Field(None, description="Per-field validation errors.")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready"]
    database: Literal["ok"]
    migration: str | None = Field(description="The database's schema revision (equal to the head).")
