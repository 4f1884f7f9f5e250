"""A sync route's response model, validated and serialised on the route's own thread.

FastAPI validates a sync route's return value in a further hop to a worker thread
(`fastapi.routing.serialize_response` with `is_coroutine=False`): on a loaded API one more wait for a
thread per request. `ModelResponseRoute` (the `route_class` of every router in service.api.routes)
wraps such an endpoint so that its thread does what FastAPI would have done next: validate the value
against the route's response field and dump it with the route's options (its JSON fast path, by
alias, include/exclude, exclude_none...), then return the bytes as a `Response` with the route's
status code, which FastAPI passes through. A `Response` the endpoint returns passes through untouched.
OpenAPI is unchanged: the wrapper has the endpoint's signature, name and docstring (`functools.wraps`;
FastAPI reads signatures through `__wrapped__`) and the route keeps its `response_model`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import Response
from fastapi.datastructures import DefaultPlaceholder
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import EndpointContext, ResponseValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel


def model_response(model: BaseModel, status_code: int = 200,
                   headers: Mapping[str, str] | None = None) -> Response:
    """A route's model as its response, for a route that also sets its status code or headers."""
    return json_response(model.model_dump_json(by_alias=True), status_code, headers)


def json_response(body: bytes | str, status_code: int = 200,
                  headers: Mapping[str, str] | None = None) -> Response:
    """Serialised JSON as FastAPI's fast path sends it (`application/json`)."""
    return Response(content=body, media_type="application/json", status_code=status_code,
                    headers=dict(headers or {}))


class ModelResponseRoute(APIRoute):
    """An APIRoute whose sync endpoint with a response model serialises its value on its own thread.

    What it checks is the route as its router declares it: an app-level `include_router` that adds a
    dependency taking a `Response`, or a default response class, is not seen (none does here)."""

    _serialise_inline = False  # decided once the route has its response field and dependencies

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        plain_sync = inspect.isfunction(endpoint) and not any(  # FastAPI looks through decorators too
            inspect.iscoroutinefunction(f) or inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f)
            for f in (endpoint, inspect.unwrap(endpoint))
        )
        super().__init__(path, self._serialising(endpoint) if plain_sync else endpoint, **kwargs)
        self._serialise_inline = (
            plain_sync
            and self.response_field is not None
            # a custom response class renders FastAPI's python-mode dump, not these bytes
            and isinstance(self.response_class, DefaultPlaceholder)
            # a `Response` parameter's headers and status apply only to a value FastAPI serialises
            and not _takes_response(self.dependant)
        )

    def _serialising(self, endpoint: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(endpoint)
        def serialised(*args: Any, **kwargs: Any) -> Any:
            content = endpoint(*args, **kwargs)
            if not self._serialise_inline or isinstance(content, Response):
                return content
            return self._render(content)

        return serialised

    def _render(self, content: Any) -> Response:
        # What fastapi.routing.get_request_handler does with a sync route's value, minus the hop.
        field = self.response_field
        assert field is not None
        value, errors = field.validate(content, {}, loc=("response",))
        if errors:
            raise ResponseValidationError(errors=errors, body=content, endpoint_ctx=self._context())
        body = field.serialize_json(
            value,
            include=self.response_model_include,
            exclude=self.response_model_exclude,
            by_alias=self.response_model_by_alias,
            exclude_unset=self.response_model_exclude_unset,
            exclude_defaults=self.response_model_exclude_defaults,
            exclude_none=self.response_model_exclude_none,
        )
        return json_response(body, self.status_code or 200)

    def _context(self) -> EndpointContext:
        """Where the endpoint is, for the error message (as FastAPI gives it)."""
        endpoint = inspect.unwrap(self.endpoint)
        context = EndpointContext(function=endpoint.__name__,
                                  path=f"{'|'.join(sorted(self.methods))} {self.path}")
        try:
            context["file"] = inspect.getsourcefile(endpoint) or ""
            context["line"] = inspect.getsourcelines(endpoint)[1]
        except (OSError, TypeError):
            pass
        return context


def _takes_response(dependant: Dependant) -> bool:
    return dependant.response_param_name is not None or any(
        _takes_response(d) for d in dependant.dependencies
    )
