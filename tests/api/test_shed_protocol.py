"""Refusals in the HTTP protocol (service/api/shed_protocol.py): a real uvicorn server on a socket. What
the shedder refuses is answered 503 + Retry-After before it becomes an ASGI task, so it never reaches
the middleware stack; probes, admitted and pipelined requests go the usual way, and a kept-alive
connection carries on after a refusal."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from service.api.overload import LoadShedMiddleware
from service.api.shed_protocol import SHED_STATE, ShedHttpProtocol


class CountingShed(LoadShedMiddleware):
    """The shedder, counting the requests that reached it as ASGI calls."""

    calls: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            CountingShed.calls.append(f"{scope['method']} {scope['path']}")
        await super().__call__(scope, receive, send)


def _app(gate: threading.Event) -> Starlette:
    async def jobs(request: Request) -> JSONResponse:
        await request.body()
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return JSONResponse({"ok": True})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    app = Starlette(
        routes=[Route("/v1/jobs", jobs, methods=["GET", "POST"]), Route("/healthz", healthz)],
        middleware=[Middleware(CountingShed, max_inflight=1, retry_after_s=3,
                               publish=lambda shed: setattr(app.state, SHED_STATE, shed))],
    )
    return app


@pytest.fixture
def server() -> Iterator[tuple[int, Starlette, threading.Event]]:
    gate = threading.Event()
    app = _app(gate)
    CountingShed.calls = []
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=ShedHttpProtocol, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield port, app, gate
    gate.set()
    srv.should_exit = True
    thread.join(10)


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Read `n` Content-Length responses off a socket."""
    data, out = b"", []
    sock.settimeout(10)
    while len(out) < n:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            fields = (line.partition(":") for line in lines[1:])
            headers = {k.strip().lower(): v.strip() for k, _, v in fields}
            length = int(headers.get("content-length", "0"))
            if len(rest) >= length:
                out.append((int(lines[0].split()[1]), headers, rest[:length]))
                data = rest[length:]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {len(out)} of {n} responses"
        data += chunk
    return out


def _get(path: str, version: str = "1.1") -> bytes:
    return f"GET {path} HTTP/{version}\r\nHost: t\r\n\r\n".encode()


def test_a_refused_request_is_answered_in_the_protocol_and_the_connection_carries_on(server) -> None:
    port, app, gate = server
    holder = socket.create_connection(("127.0.0.1", port))
    holder.sendall(_get("/v1/jobs"))  # takes the one request the bound allows
    deadline = time.monotonic() + 10
    while getattr(app.state, SHED_STATE, None) is None or app.state.load_shed.inflight < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)

    client = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"name": "x" * 100}).encode()
    post = f"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    client.sendall(post + _get("/healthz"))  # pipelined on one connection
    refused, probe = _responses(client, 2)
    client.sendall(_get("/v1/jobs"))  # the same connection, kept alive after a refusal
    [refused_again] = _responses(client, 1)

    for status, headers, payload in (refused, refused_again):
        assert status == 503 and headers["retry-after"] == "3"
        assert headers["content-type"] == "application/problem+json"
        problem = json.loads(payload)
        assert problem["status"] == 503 and "bound of 1 requests in flight" in problem["detail"]
    assert probe[0] == 200 and json.loads(probe[2]) == {"status": "ok"}
    # Only the held request and the probe became ASGI calls: the refusals never reached the app.
    assert CountingShed.calls == ["GET /v1/jobs", "GET /healthz"]

    old = socket.create_connection(("127.0.0.1", port))
    old.sendall(_get("/v1/jobs", version="1.0"))
    [(status, headers, _)] = _responses(old, 1)
    assert status == 503 and headers["connection"] == "close"
    old.settimeout(10)
    assert old.recv(100) == b""  # HTTP/1.0 without keep-alive: closed after the answer

    gate.set()
    assert _responses(holder, 1)[0][0] == 200
    deadline = time.monotonic() + 10
    while app.state.load_shed.inflight:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.sendall(_get("/v1/jobs"))  # the same kept-alive connection, now admitted
    assert _responses(client, 1)[0][0] == 200
    assert CountingShed.calls[-1] == "GET /v1/jobs" and len(CountingShed.calls) == 3
    for sock in (holder, client, old):
        sock.close()
