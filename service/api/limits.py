"""Request body limit, enforced before anything reads the body: before authentication, before JSON
parsing (FastAPI parses a body before it resolves the route's dependencies, auth included).

A pure ASGI middleware: a declared `Content-Length` above the limit is answered 413 at once, without
reading a byte; a body without one (chunked) is read here, counting, and answered 413 as soon as it
passes the limit, so at most `max_bytes` of it is ever held in memory.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.problems import problem_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await self._reject(scope, receive, send, 400, "Bad request", "Content-Length is not a length")
            return
        if declared is not None:
            if declared > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops the body at its declared length
            return
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._reject(
            scope, receive, send, 413, "Request body too large",
            f"the request body is larger than the server's limit of {self.max_bytes} bytes "
            "(LATTICE_MAX_BODY_BYTES)",
        )

    @staticmethod
    async def _reject(
        scope: Scope, receive: Receive, send: Send, status: int, title: str, detail: str
    ) -> None:
        response = problem_response(
            status, title, detail, instance=scope.get("path"), headers={"Connection": "close"}
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when it is not a length."""
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return -1
            return length if length >= 0 else -1
    return None
