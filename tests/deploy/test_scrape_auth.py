"""A real Prometheus with the deploy config's `authorization` block scrapes a target that, like the
API under LATTICE_METRICS_AUTH=true, answers only `Authorization: Bearer <scrape token>`: the token
comes from the credentials file, is re-read on every scrape (rotation needs no restart), and a wrong
one leaves the target down."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.deploy.prom import SCRAPE_JOB, start_prometheus, wait_for_value
from tests.deploy.promql import PROMETHEUS_CONFIG
from tests.deploy.tools import require_binary


class _Target(ThreadingHTTPServer):
    expected = ""


class _Handler(BaseHTTPRequestHandler):
    server: _Target

    def do_GET(self) -> None:  # the http.server API
        if self.headers.get("Authorization") != f"Bearer {self.server.expected}":
            self.send_response(401)
            self.end_headers()
            return
        body = b"lattice_scrape_auth_probe 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def target() -> Iterator[_Target]:
    server = _Target(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_sends_the_scrape_token_of_its_credentials_file(target: _Target, tmp_path: Path) -> None:
    require_binary("prometheus", "prometheus")
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == SCRAPE_JOB]
    authorization = dict(job["authorization"])
    token_file = tmp_path / "token"
    authorization["credentials_file"] = str(token_file)  # the compose volume's file, here
    token_file.write_text("first-token\n")
    target.expected = "first-token"
    address = f"127.0.0.1:{target.server_address[1]}"
    server = start_prometheus([address], tmp_path, job_options={"authorization": authorization})
    up = f'up{{job="{SCRAPE_JOB}"}}'
    try:
        wait_for_value(server.url, up, lambda v: v == 1)
        assert wait_for_value(server.url, "lattice_scrape_auth_probe", lambda v: v == 1) == [1]
        # the target now wants another token: the old one is refused, the target is down
        target.expected = "second-token"
        wait_for_value(server.url, up, lambda v: v == 0)
        # rotating the file is enough: Prometheus reads it again at the next scrape
        token_file.write_text("second-token\n")
        wait_for_value(server.url, up, lambda v: v == 1)
    finally:
        server.stop()
