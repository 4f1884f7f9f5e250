"""POST /v1/plans: plan (or evaluate) a parallel layout. Placeholder until the planner lands."""

from __future__ import annotations

import fastapi

router = fastapi.APIRouter()


@router.post("/v1/plans")
def create_plan(body: dict) -> dict:
    raise fastapi.HTTPException(status_code=503, detail="planner not ready yet")
