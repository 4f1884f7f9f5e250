"""Every error the API returns is an RFC 9457 `application/problem+json` document.

Validation errors name each offending field as a dotted path of the request body
(`model.hidden`, `parallelism.tp`), or the query/path/header parameter, with what is allowed.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as SQLAlchemyTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.overload import EXEMPT_PATHS as OVERLOAD_EXEMPT_PATHS
from service.errors import LatticeError
from service.schemas import FieldError, JobSpec, Problem

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
DB_RETRY_AFTER_S = 5  # Retry-After of a 503 for an unavailable database

# Union branch tags the schemas add to error locations; they are not fields the user wrote.
_UNION_TAGS = {
    ("model", "by_preset"),
    ("model", "explicit"),
    ("parallelism", "auto"),
    ("parallelism", "layout"),
    ("parallelism", "line"),
}
_LOCATIONS = {"body", "query", "path", "header", "cookie"}
# A message that starts with a field path names the field better than the location of the validator.
_LEADING_FIELD = re.compile(r"^([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*)(?=[ :])")
_TOP_FIELDS = set(JobSpec.model_fields)


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_MEDIA_TYPE


def problem_response(
    status: int,
    title: str,
    detail: str,
    *,
    instance: str | None = None,
    errors: Sequence[FieldError] | None = None,
    headers: dict[str, str] | None = None,
) -> ProblemResponse:
    body = Problem(
        title=title, status=status, detail=detail, instance=instance, errors=list(errors) if errors else None
    )
    return ProblemResponse(
        body.model_dump(mode="json", exclude_none=True), status_code=status, headers=headers
    )


def _field_path(loc: Sequence[Any]) -> tuple[str, str]:
    """('body', 'model', 'explicit', 'hidden') -> ('body', 'model.hidden')."""
    parts = list(loc)
    location = "body"
    if parts and parts[0] in _LOCATIONS:
        location = str(parts.pop(0))
    cleaned: list[str] = []
    for part in parts:
        if cleaned and (cleaned[-1], part) in _UNION_TAGS:
            continue
        if isinstance(part, int):
            cleaned[-1:] = [f"{cleaned[-1]}[{part}]"] if cleaned else [f"[{part}]"]
        else:
            cleaned.append(str(part))
    return location, ".".join(cleaned)


def _clean_message(msg: str) -> str:
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


def field_errors(errors: Sequence[Any]) -> list[FieldError]:
    out: list[FieldError] = []
    for err in errors:
        location, path = _field_path(err.get("loc", ()))
        message = _clean_message(str(err.get("msg", "invalid value")))
        leading = _LEADING_FIELD.match(message)
        if location == "body" and leading and leading.group(1).split(".")[0].split("[")[0] in _TOP_FIELDS:
            if not path or leading.group(1).startswith(path):
                path = leading.group(1)
        if err.get("type") == "missing":
            message = "field required"
        elif err.get("type") == "extra_forbidden":
            message = "unknown field (not allowed here)"
        if path and message.startswith(f"{path}: "):
            message = message[len(path) + 2 :]
        if location == "body" and not path:
            path = "body" if err.get("type") in ("missing", "json_invalid", "model_attributes_type") else path
        out.append(FieldError(field=path or location, message=message, location=location))  # type: ignore[arg-type]
    return out


def install_problem_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> ProblemResponse:
        errors = field_errors(exc.errors())
        detail = "; ".join(
            e.message if e.message.startswith(e.field) else f"{e.field}: {e.message}" for e in errors[:5]
        )
        if len(errors) > 5:
            detail += f"; and {len(errors) - 5} more"
        return problem_response(422, "Invalid request", detail, instance=request.url.path, errors=errors)

    @app.exception_handler(LatticeError)
    async def _lattice(request: Request, exc: LatticeError) -> ProblemResponse:
        errors = [FieldError.model_validate(e) for e in exc.errors] if exc.errors else None
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        retry_after = getattr(exc, "retry_after_s", None)  # e.g. service.api.planning.PlanningBusy
        if retry_after is not None:
            headers = {"Retry-After": str(retry_after)}
        return problem_response(
            exc.status, exc.title, exc.detail, instance=request.url.path, errors=errors, headers=headers
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> ProblemResponse:
        from http import HTTPStatus

        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            # Undecodable bytes: the same "invalid body" answer as malformed JSON gets.
            deep = isinstance(exc.__cause__, RecursionError)  # FastAPI raises `from` the parser's error
            message = "nests too deeply" if deep else "is not valid UTF-8 JSON"
            message = f"the request body {message}"
            error = FieldError(field="body", message=message, location="body")
            return problem_response(
                422, "Invalid request", f"body: {error.message}", instance=request.url.path, errors=[error]
            )
        title = (
            HTTPStatus(exc.status_code).phrase
            if exc.status_code in HTTPStatus._value2member_map_
            else "Error"
        )
        detail = exc.detail if isinstance(exc.detail, str) else title
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        return problem_response(
            exc.status_code, title, detail, instance=request.url.path, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(DBAPIError)
    @app.exception_handler(SQLAlchemyTimeout)
    async def _database(request: Request, exc: Exception) -> ProblemResponse:
        if not database_unavailable(exc):
            return await _unexpected(request, exc)
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return problem_response(
            503, "Service unavailable",
            f"the database is unavailable; retry in {DB_RETRY_AFTER_S} s",
            instance=request.url.path, headers={"Retry-After": str(DB_RETRY_AFTER_S)},
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> ProblemResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            500, "Internal error", "the server failed; see its log", instance=request.url.path
        )


def database_unavailable(exc: BaseException) -> bool:
    """A lost or refused connection, a pool timeout, a locked or unreachable database: worth a retry."""
    if isinstance(exc, SQLAlchemyTimeout | OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


PROBLEM_CONTENT = {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries documenting problem+json for these statuses."""
    descriptions = {
        401: "Missing or invalid bearer token.",
        403: "The token's role may not do this.",
        404: "No such job (or not visible to this tenant).",
        409: "Conflict with the current state (illegal transition, reused idempotency key).",
        422: "Invalid input; `errors` names each field and what is allowed.",
        413: "The request body is larger than LATTICE_MAX_BODY_BYTES.",
        503: "Not ready, or the database is unavailable (retry after `Retry-After` seconds).",
    }
    return {s: {"description": descriptions.get(s, "Error."), "content": PROBLEM_CONTENT} for s in statuses}


def add_problem_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """Put Problem (and FieldError) into components, and document every error response of every
    route (including FastAPI's default 422 and routers that do not use `problem_responses`) as
    the problem+json that the handlers above actually send."""
    schema = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    components.update(defs)
    components["Problem"] = schema
    for path, path_item in openapi.get("paths", {}).items():
        for operation in path_item.values():
            if path not in OVERLOAD_EXEMPT_PATHS:  # the overload middlewares may answer any other route
                _document_overload(operation.setdefault("responses", {}))
            for status, response in operation.get("responses", {}).items():
                if status[0] in "45" and "application/json" in response.get("content", {}):
                    response["content"] = dict(PROBLEM_CONTENT)
    for unused in ("HTTPValidationError", "ValidationError"):
        if unused not in _refs(openapi.get("paths", {})):
            components.pop(unused, None)
    return openapi


def _document_overload(responses: dict[str, Any]) -> None:
    """429 (rate limit) and 503 (load shed) with their Retry-After header (service/api/overload.py)."""
    retry_after = {
        "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}
    }
    overload = {
        "429": "Over this token's request rate (LATTICE_RATE_LIMIT_PER_S); retry after `Retry-After`.",
        "503": "Overloaded, not ready, or the database is unavailable; retry after `Retry-After` seconds.",
    }
    for status, description in overload.items():
        default = {"description": description, "content": dict(PROBLEM_CONTENT)}
        response = responses.setdefault(status, default)
        response.setdefault("headers", {}).update(retry_after)


def _refs(node: Any) -> str:
    return json.dumps(node)
