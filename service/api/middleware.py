"""HTTP metrics: requests and latency by route template (not raw path: bounded label cardinality)."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import metrics


class MetricsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            # The router puts the matched route into the (shared) scope.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            metrics.HTTP_REQUESTS.labels(route, method, str(status)).inc()
            metrics.HTTP_LATENCY.labels(route, method).observe(time.perf_counter() - start)
