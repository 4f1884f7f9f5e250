"""A route's model as its response, serialised on the route's own thread.

FastAPI validates and serialises a sync route's return value in a further hop to a worker thread
(`fastapi.routing.serialize_response`): on a loaded API one more wait for a thread per request. The hot
routes (submit, get) return the JSON FastAPI would have produced (its fast path: the model's pydantic
core, by alias) as a `Response`, which FastAPI passes through; the route's `response_model` still
documents it in OpenAPI.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Response
from pydantic import BaseModel


def model_response(model: BaseModel, status_code: int = 200,
                   headers: Mapping[str, str] | None = None) -> Response:
    return Response(content=model.model_dump_json(by_alias=True), media_type="application/json",
                    status_code=status_code, headers=dict(headers or {}))
