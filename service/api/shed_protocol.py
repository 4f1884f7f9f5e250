"""Refusals answered in the HTTP protocol, before a request becomes an ASGI task.

Past its capacity the API refuses most of what arrives (503 + Retry-After, service.api.overload). Each
refusal used to cost a task, a receive/send cycle and the trip through FastAPI's middleware stack:
CPU taken from the requests the API had accepted. `ShedHttpProtocol` is uvicorn's httptools
protocol with one change: once a request's headers are parsed, it asks the app's `LoadShedMiddleware`
(the same decision, `refusal_for(path)`) and, when refused, writes the canned 503 to the socket
itself. Everything else (probes, admitted requests, pipelined requests behind one in progress) goes
the usual way, through the middleware, which decides again.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.api.overload import LoadShedMiddleware, problem

SHED_STATE = "load_shed"  # app.state attribute the middleware publishes itself under
_UNWRAP_DEPTH = 8  # uvicorn's wrappers (proxy headers, message logger) around the FastAPI app


def find_shedder(app: Any) -> LoadShedMiddleware | None:
    """The middleware the app published, looking through uvicorn's wrappers; None before the app's
    middleware stack is built (its first request) or when it sheds nothing."""
    for _ in range(_UNWRAP_DEPTH):
        if app is None:
            return None
        shedder = getattr(getattr(app, "state", None), SHED_STATE, None)
        if shedder is not None:
            return shedder
        app = getattr(app, "app", None)
    return None


class ShedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing on the event loop what the app's shedder refuses."""

    _shedder: LoadShedMiddleware | None = None

    def on_headers_complete(self) -> None:
        if self._shed_now():
            return
        super().on_headers_complete()

    def _shed_now(self) -> bool:
        """Answer this request 503 here if the shedder refuses it; False: go the usual way."""
        if self.cycle is not None and not self.cycle.response_complete:
            return False  # pipelined behind a request in progress: responses must keep their order
        if self.parser.should_upgrade():
            return False
        if self._shedder is None:
            self._shedder = find_shedder(self.app)
            if self._shedder is None:
                return False
        raw_path = httptools.parse_url(self.url).path.decode("ascii")
        path = self.root_path + (urllib.parse.unquote(raw_path) if "%" in raw_path else raw_path)
        refusal = self._shedder.refusal_for(path)
        if refusal is None:
            return False
        self._answer(refusal)
        return True

    def _answer(self, refusal: str) -> None:
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        self.cycle = _ANSWERED  # type: ignore[assignment]  # complete: the body that follows is dropped
        headers, body = problem(503, "Service Unavailable", refusal, self._shedder.retry_after_s)  # type: ignore[union-attr]
        if not keep_alive:
            headers.append((b"connection", b"close"))
        lines = [STATUS_LINE[503]]
        for name, value in [*self.server_state.default_headers, *headers]:
            lines += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*lines, b"\r\n", body]))
        if keep_alive:
            self.on_response_complete()
        else:
            self.transport.close()


class _NoWaiter:
    def set(self) -> None:  # connection_lost wakes a cycle's body waiter: an answered one has none
        pass


class _Answered:
    """What uvicorn's protocol reads of a request's cycle, for one answered here: complete, so its body
    is dropped, the next request starts at once and a shutdown closes the idle connection. Shared and
    never changed (setting `disconnected` or `keep_alive` happens only to incomplete cycles)."""

    response_complete = True
    message_event = _NoWaiter()


_ANSWERED = _Answered()
