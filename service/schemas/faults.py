"""Faults to inject into a job (fault-tolerance testing and demos)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

if TYPE_CHECKING:
    pass
from service.schemas.common import MAX_COUNT, MAX_DEGREE

FaultKind = Literal["kill_rank", "kill_node", "hang_rank", "slow_rank", "bitflip", "corrupt_checkpoint"]


class FaultSpec(BaseModel):
    """A fault to inject (acted on only when the service has fault injection enabled)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    kind: FaultKind = Field(description="What to break.")
    at_step: int = Field(ge=0, le=MAX_COUNT, description="Step at which the fault fires.")
    rank: int | None = Field(None, ge=0, le=MAX_DEGREE, description="Target rank (rank faults).")
    node: str | None = Field(None, min_length=1, max_length=128, description="Target node (node faults).")
