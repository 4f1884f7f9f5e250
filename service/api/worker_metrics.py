"""/metrics of an API that runs several worker processes (`lattice serve --role api --workers N`).

A scrape reaches one worker, chosen by the kernel. Counters and histograms (requests, latency by
route and status) are summed over every worker from prometheus_client's multiprocess files, the files
of workers that died and were replaced included, so a counter never goes backwards when the scrape
lands on another worker or a worker restarts. Gauges come from the worker that answers: in an API
process they are either computed at scrape time from the database (jobs by state, queue depth: the
same in every worker) or the scheduler's (0 in an API process), so a per-worker `pid` label would only
multiply the series.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector


class WorkerAggregateCollector(Collector):
    """Counters and histograms of all workers (from `path`), gauges of this one (from `local`)."""

    def __init__(self, path: str, local: CollectorRegistry) -> None:
        self.shared = MultiProcessCollector(None, path=path)  # None: not registered anywhere
        self.local = local

    def collect(self) -> Iterable[Metric]:
        for family in self.shared.collect():
            if family.type != "gauge":
                yield family
        for family in self.local.collect():
            if family.type == "gauge":
                yield family
