"""Graceful overload: shed what the API cannot serve soon, at once, instead of queueing it.

Two pure ASGI middlewares, both answering before authentication, parsing or a worker thread:

- `LoadShedMiddleware`: the API measures its own queue (requests accepted and not yet answered,
  whether running or waiting for a worker thread); past `max_inflight` a request gets 503 with
  `Retry-After`. Accepted work keeps its latency, so accepted throughput does not fall as offered
  load rises.
- `RateLimitMiddleware`: a token bucket per bearer token (per client address without one);
  a request over the rate gets 429 with `Retry-After`, the seconds until the bucket has a token again.

Liveness, readiness and metrics are never shed or limited: a probe must see the process as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


async def _problem(send: Send, status: int, title: str, detail: str, retry_after_s: float) -> None:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),
        ],
    })
    await send({"type": "http.response.body", "body": body})


class LoadShedMiddleware:
    """503 + Retry-After once `max_inflight` requests are in the API (0: no bound)."""

    def __init__(self, app: ASGIApp, max_inflight: int, retry_after_s: float = 1.0) -> None:
        self.app = app
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.inflight = 0  # the event loop is single-threaded: no lock needed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in EXEMPT_PATHS or self.max_inflight <= 0:
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.max_inflight:
            await _problem(send, 503, "Service Unavailable",
                           f"the API is at its bound of {self.max_inflight} requests in flight; retry later",
                           self.retry_after_s)
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1


class TokenBuckets:
    """`rate` tokens a second up to `burst`, per key; at most `max_keys` keys (least recently used go)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got rate={rate}, burst={burst}")
        self.rate, self.burst, self.max_keys, self.clock = rate, burst, max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: str) -> float:
        """Take one token for `key`: 0.0 when granted, else the seconds until one is available."""
        now = self.clock()
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait


def _client_key(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return "token:" + hashlib.sha256(value).hexdigest()  # never keep the secret itself
    client = scope.get("client")
    return f"addr:{client[0] if client else 'unknown'}"


class RateLimitMiddleware:
    """429 + Retry-After for a token (or client address) over `rate` requests a second (0: off)."""

    def __init__(self, app: ASGIApp, rate: float, burst: float) -> None:
        self.app = app
        self.buckets = TokenBuckets(rate, burst) if rate > 0 else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.buckets is not None and scope.get("path") not in EXEMPT_PATHS:
            wait = self.buckets.take(_client_key(scope))
            if wait > 0:
                await _problem(send, 429, "Too Many Requests",
                               f"over the rate limit of {self.buckets.rate:g} requests/s per token; "
                               f"retry in {wait:.2f}s", wait)
                return
        await self.app(scope, receive, send)
