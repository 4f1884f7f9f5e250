"""Exports of a job's checkpoint (`POST /v1/jobs/{id}/exports`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.schemas.common import MAX_COUNT, StrictModel

ExportFormat = Literal["hf", "torch"]
ExportState = Literal["running", "succeeded", "failed"]


class ExportCreate(StrictModel):
    format: ExportFormat = Field(
        "hf", description="hf: a Hugging Face Llama (dense) or Mixtral (MoE) folder; torch: one state_dict + "
        "spec (the default is what `model.init_from` and most tools read)."
    )
    step: int | None = Field(None, ge=0, le=MAX_COUNT, description="Checkpoint step; unset = the newest.")
    output: str | None = Field(
        None, min_length=1, max_length=4096,
        description="A new folder inside the data root (relative to it, or absolute under it); "
        "unset = exports/<job id>-<export id> in the data root.",
    )


class ExportPublic(BaseModel):
    id: str
    job_id: str
    state: ExportState
    format: ExportFormat
    step: int | None = Field(None, description="The checkpoint step exported (known once it succeeded).")
    output: str = Field(description="The folder the files are written to (inside the data root).")
    files: list[str] = Field(default_factory=list)
    error: str | None = None
    result: dict[str, Any] | None = Field(None, description="What was written (once succeeded).")
