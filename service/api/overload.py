"""Graceful overload: shed what the API cannot serve soon, at once, instead of queueing it.

Two pure ASGI middlewares, both answering before authentication, parsing or a worker thread:

- `LoadShedMiddleware`: the API runs a few requests at once (a slot per worker thread) and measures
  its own queue for them: while the oldest waiter has waited longer than a bound, or past
  `max_inflight` held in all, a new request gets 503 with `Retry-After` on the event loop. Accepted
  work waits at most about the bound. (Before: 40 threads behind a bound of 64 in flight; the
  threads fought the event loop for the GIL, so probes and 503s waited too.)
- `RateLimitMiddleware`: a token bucket per bearer token (per client address without one);
  a request over the rate gets 429 with `Retry-After`, the seconds until the bucket has a token again.

Liveness, readiness and metrics are never shed or limited: a probe must see the process as it is.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

EXEMPT_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Bounded by their own admission (the planning pool): counted in flight, but they hold no slot
# while a worker process searches.
UNGATED_PATHS = frozenset({"/v1/plans"})
# A request admitted to the queue waits up to this many times the bound before it is refused: a burst
# that arrives at once is absorbed, a stuck slot is not waited on forever.
QUEUED_TIMEOUT_FACTOR = 10


Headers = list[tuple[bytes, bytes]]


def problem(status: int, title: str, detail: str, retry_after_s: float) -> tuple[Headers, bytes]:
    """(headers, body) of a refusal: problem+json with Retry-After in whole seconds (at least 1)."""
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    return [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(max(1, math.ceil(retry_after_s))).encode()),
    ], body


async def _problem(send: Send, status: int, title: str, detail: str, retry_after_s: float) -> None:
    headers, body = problem(status, title, detail, retry_after_s)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(eq=False)
class _Waiter:
    since: float
    event: anyio.Event = field(default_factory=anyio.Event)
    granted: bool = False  # a finishing request handed its slot over


class LoadShedMiddleware:
    """Run at most `concurrency` requests at once (one worker thread each), queue a few more FIFO, and
    answer the rest 503 + Retry-After at once, on the event loop.

    A request is refused on arrival when `max_inflight` requests are already held (0: never shed; the
    queue for a slot is then unbounded, the old "no bound"), or when the queue for a slot is older
    than `max_queue_wait_s` (the oldest waiter's age: under sustained overload the queue holds about
    that much work, so accepted requests wait about that long, while a burst that arrives at once is
    absorbed up to `max_inflight`). A queued request that still has no slot after
    QUEUED_TIMEOUT_FACTOR times that (a handler stuck) is refused then. A request gives its slot
    back when its response starts, so a long stream (a followed log) does not hold one. With `threads`,
    the middleware sizes anyio's default thread limiter (FastAPI's sync routes and dependencies) to it:
    few threads keep the event loop, which admits and sheds, from starving on the GIL.
    """

    def __init__(self, app: ASGIApp, max_inflight: int, concurrency: int = 0, max_queue_wait_s: float = 0.1,
                 threads: int = 0, retry_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic,
                 publish: Callable[[LoadShedMiddleware], None] | None = None) -> None:
        self.app = app
        self.max_inflight = max_inflight
        self.concurrency = concurrency
        self.max_queue_wait_s = max_queue_wait_s
        self.threads = threads
        self.retry_after_s = retry_after_s
        self.clock = clock
        # The event loop is single-threaded: no lock needed for any of these.
        self.inflight = 0  # requests held: running or queued
        self.running = 0  # requests holding a slot
        self._waiters: deque[_Waiter] = deque()
        if publish is not None:  # the HTTP protocol asks it before a request becomes an ASGI task
            publish(self)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def oldest_wait_s(self) -> float:
        return self.clock() - self._waiters[0].since if self._waiters else 0.0

    def refusal_for(self, path: str) -> str | None:
        """Why a request for `path` arriving now is refused (None: admit it). Never refuses a probe."""
        if path in EXEMPT_PATHS:
            return None
        return self._refusal(self._gated(path))

    def _gated(self, path: str | None) -> bool:
        """Whether a request for `path` must hold one of the `concurrency` slots (queueing for it)."""
        return self.concurrency > 0 and path not in UNGATED_PATHS

    def _refusal(self, gated: bool) -> str | None:
        if self.max_inflight <= 0:
            return None
        if self.inflight >= self.max_inflight:
            return f"the API is at its bound of {self.max_inflight} requests in flight; retry later"
        if not gated or self.running < self.concurrency:
            return None
        bound_ms = self.max_queue_wait_s * 1e3
        waited = self.oldest_wait_s()
        if waited >= self.max_queue_wait_s:
            return (f"the oldest request waiting for a worker has waited {waited * 1e3:.0f} ms (the bound is "
                    f"{bound_ms:.0f} ms); retry later")
        return None

    async def _acquire(self) -> bool:
        """A slot: at once, or after waiting (False: none came within the backstop)."""
        if self.running < self.concurrency and not self._waiters:
            self.running += 1
            return True
        waiter = _Waiter(self.clock())
        self._waiters.append(waiter)
        try:
            backstop = self.max_queue_wait_s * QUEUED_TIMEOUT_FACTOR if self.max_inflight > 0 else None
            with anyio.move_on_after(backstop):
                await waiter.event.wait()
        except BaseException:  # cancelled (the client went away): give back what was handed over
            if waiter.granted:
                self._release()
            else:
                self._waiters.remove(waiter)
            raise
        if not waiter.granted:
            self._waiters.remove(waiter)
        return waiter.granted

    def _release(self) -> None:
        if self._waiters:
            waiter = self._waiters.popleft()  # the slot passes to the oldest waiter: running is unchanged
            waiter.granted = True
            waiter.event.set()
        else:
            self.running -= 1

    def _size_threads(self) -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()  # one per event loop
        if limiter.total_tokens != self.threads:
            limiter.total_tokens = self.threads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.threads > 0 and scope["type"] == "http":
            self._size_threads()
        if scope["type"] != "http" or scope.get("path") in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        gated = self._gated(scope.get("path"))
        refusal = self._refusal(gated)
        if refusal is not None:
            await _problem(send, 503, "Service Unavailable", refusal, self.retry_after_s)
            return
        self.inflight += 1
        try:
            if not gated:
                await self.app(scope, receive, send)
            elif not await self._acquire():
                waited = f"{self.max_queue_wait_s * QUEUED_TIMEOUT_FACTOR * 1e3:.0f} ms"
                await _problem(send, 503, "Service Unavailable",
                               f"no worker became free within {waited}; retry later", self.retry_after_s)
            else:
                await self._run_holding_slot(scope, receive, send)
        finally:
            self.inflight -= 1

    async def _run_holding_slot(self, scope: Scope, receive: Receive, send: Send) -> None:
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._release()

        async def send_releasing(message: Message) -> None:
            if message["type"] == "http.response.start":
                release()  # the handler is done; a streamed body does not hold the slot
            await send(message)

        try:
            await self.app(scope, receive, send_releasing)
        finally:
            release()


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
