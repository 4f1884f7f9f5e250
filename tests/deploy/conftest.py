"""Fixtures of the deploy tests: a stand-in scrape target and a real Prometheus scraping it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.metrics_target import EXAMPLE_JOB
from tests.deploy.prom import PromServer, start_prometheus, wait_for_value
from tests.deploy.tools import ROOT, require_binary


@dataclass
class MetricsTarget:
    """The metrics_target process: service.metrics.REGISTRY on 127.0.0.1:port, driven over stdin."""

    process: subprocess.Popen[str]
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self, line: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline().strip()
        assert reply == "OK", f"metrics target answered {reply!r} to {line!r}"


@pytest.fixture(scope="session")
def metrics_target() -> Iterator[MetricsTarget]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.deploy.metrics_target"],
        cwd=ROOT,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    first = process.stdout.readline().split()
    if first[:1] != ["PORT"]:
        process.kill()
        pytest.fail(f"metrics target did not start: {first}")
    target = MetricsTarget(process, int(first[1]))
    try:
        yield target
    finally:
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.write("quit\n")
            process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def prometheus(
    metrics_target: MetricsTarget, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PromServer]:
    """A real Prometheus (scrape interval 1 s) that has scraped the metrics target at least once."""
    require_binary("prometheus", "prometheus")
    server = start_prometheus([metrics_target.address], Path(tmp_path_factory.mktemp("prom")))
    try:
        wait_for_value(server.url, f'lattice_job_step{{job_id="{EXAMPLE_JOB}"}}', lambda v: v > 0)
        yield server
    finally:
        server.stop()
