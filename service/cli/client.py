"""The CLI's HTTP client: where the server and token come from, and one-line errors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx

from service.settings import Settings

TERMINAL = ("succeeded", "failed", "cancelled")
_TOKEN = re.compile(r"[\x21-\x7e]+")


def api_path(*segments: str) -> str:
    """`/v1/a/b/...`, each segment escaped: a name given as `a/../b` names no other resource."""
    return "/v1/" + "/".join(quote(s, safe="") for s in segments)


def job_path(job_id: str, *rest: str) -> str:
    return api_path("jobs", job_id, *rest)


class CliError(Exception):
    """A failure the CLI reports as one line on stderr (exit code 1)."""


def _read_first_line(path: Any) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text.splitlines()[0].strip() if text else None


class Client:
    def __init__(self, server: str, token: str | None, timeout: float = 30.0) -> None:
        self.server = server.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    @classmethod
    def resolve(cls, settings: Settings, *, server: str | None = None, token: str | None = None) -> Client:
        """Flags, then settings (LATTICE_SERVER / LATTICE_TOKEN), then the files `lattice serve` wrote."""
        server = server or settings.server or _read_first_line(settings.server_file)
        server = server or f"http://{settings.host}:{settings.port}"
        token = token or settings.token or _read_first_line(settings.token_path)
        if not server.startswith(("http://", "https://")):
            raise CliError(f"server URL must start with http:// or https://, got {server!r}")
        if token is not None and not _TOKEN.fullmatch(token):  # it travels in an HTTP header
            raise CliError("the API token (--token, LATTICE_TOKEN or the token file) must be printable "
                           "ASCII without spaces")
        try:
            return cls(server, token)
        except httpx.InvalidURL as e:
            raise CliError(f"server URL {server!r} is not a valid URL: {e}") from e

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as e:
            raise CliError(
                f"the Lattice server at {self.server} did not answer in time ({type(e).__name__})"
            ) from e
        except httpx.TransportError as e:
            reason = str(e) or type(e).__name__
            raise CliError(
                f"cannot reach the Lattice server at {self.server} ({reason}); is `lattice serve` running?"
            ) from e
        if response.is_error:
            raise CliError(_describe_error(response))
        try:
            return response.json()
        except ValueError as e:
            raise CliError(f"{method} {path}: the server sent a response that is not JSON") from e

    def stream_text(self, path: str, params: dict[str, Any], *, follow: bool = False) -> Iterator[str]:
        """GET a plain-text endpoint and yield its text as it arrives (no read timeout when
        following: the server may stay quiet for a long time)."""
        timeout = httpx.Timeout(self._http.timeout.connect, read=None) if follow else self._http.timeout
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout) as response:
                if response.is_error:
                    response.read()
                    raise CliError(_describe_error(response))
                yield from response.iter_text()
        except httpx.TimeoutException as e:
            raise CliError(f"the Lattice server at {self.server} did not answer in time "
                           f"({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise CliError(f"cannot reach the Lattice server at {self.server} "
                           f"({str(e) or type(e).__name__})") from e


def _describe_error(response: httpx.Response) -> str:
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if isinstance(problem, dict) and "detail" in problem:
        title = problem.get("title") or response.reason_phrase
        return f"{response.status_code} {title}: {problem['detail']}"
    return f"{response.status_code} {response.reason_phrase}"
