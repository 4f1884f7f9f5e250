"""Faults to inject into a job (fault-tolerance testing and demos)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    model_validator,
)

if TYPE_CHECKING:
    pass
from service.schemas.common import MAX_COUNT, MAX_DEGREE, MAX_JSON_BYTES, StrictModel, check_json_bounds

FaultKind = Literal["kill_rank", "kill_node", "hang_rank", "slow_rank", "bitflip", "corrupt_checkpoint"]


class FaultSpec(StrictModel):
    """A fault to inject (acted on only when the service has fault injection enabled).

    The fields are those workers.faults.normalize_fault knows; any other field is an error."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    kind: FaultKind = Field(description="What to break.")
    at_step: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNT,
        description="Step after which the fault fires; unset = the next step (the job's current step + 1, "
        "or step 1 for a fault in the spec).",
    )
    rank: int | None = Field(None, ge=0, le=MAX_DEGREE, description="Target rank (rank faults).")
    node: str | None = Field(None, min_length=1, max_length=128, description="Target node (node faults).")
    phase: Literal["step", "checkpoint"] | None = Field(
        None, description="'step' (after step at_step; default) or 'checkpoint' (inside the next save)."
    )
    seconds: float | None = Field(None, gt=0, le=3600, description="slow_rank: delay per step (default 1).")
    target: Literal["param", "grad", "reduce"] | None = Field(
        None, description="bitflip: a weight, a local gradient, or a reduced gradient bucket.")
    name: str | None = Field(None, min_length=1, max_length=256, description="bitflip: parameter name.")
    index: int | None = Field(None, ge=0, le=1 << 40, description="bitflip: element index.")
    bit: int | None = Field(None, ge=0, le=63, description="bitflip: bit to flip (default 30).")
    persistent: bool | None = Field(None, description="bitflip: recurs on every re-run (a faulty device).")
    mode: Literal["flip", "truncate", "delete"] | None = Field(
        None, description="corrupt_checkpoint: how to damage the file."
    )
    which: str | None = Field(
        None, min_length=1, max_length=256,
        description="corrupt_checkpoint: 'any', 'metadata', 'manifest' or a file name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        check_json_bounds(data, "", max_bytes=MAX_JSON_BYTES)
        return data
