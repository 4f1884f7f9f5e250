"""A real Prometheus scrapes service.metrics.REGISTRY over HTTP and answers PromQL about a job."""

from __future__ import annotations

from tests.deploy.conftest import MetricsTarget
from tests.deploy.metrics_target import EXAMPLE_JOB, EXAMPLE_STEP, EXAMPLE_TOKENS_PER_S
from tests.deploy.prom import SCRAPE_JOB, PromServer, query, wait_for_value, wait_until_absent


def test_step_and_throughput_of_an_active_job_reach_prometheus(prometheus: PromServer) -> None:
    step = wait_for_value(prometheus.url, f'lattice_job_step{{job_id="{EXAMPLE_JOB}"}}', lambda v: v > 0)
    tokens = wait_for_value(
        prometheus.url, f'lattice_job_tokens_per_second{{job_id="{EXAMPLE_JOB}"}}', lambda v: v > 0
    )
    assert step == [EXAMPLE_STEP]
    assert tokens == [EXAMPLE_TOKENS_PER_S]
    (series,) = query(prometheus.url, f'lattice_job_step{{job_id="{EXAMPLE_JOB}"}}')
    assert series["metric"]["job"] == SCRAPE_JOB  # the label alerts.yml's up{job=...} rules rely on


def test_progress_is_visible_and_a_finished_job_disappears(
    prometheus: PromServer, metrics_target: MetricsTarget
) -> None:
    metrics_target.command("set-job scrape-1 1 10")
    wait_for_value(prometheus.url, 'lattice_job_step{job_id="scrape-1"}', lambda v: v == 1)
    metrics_target.command("set-job scrape-1 7 10")
    wait_for_value(prometheus.url, 'lattice_job_step{job_id="scrape-1"}', lambda v: v == 7)
    assert query(prometheus.url, 'lattice_job_restarts_total{job_id="scrape-1"}')

    metrics_target.command("forget scrape-1")
    # forget_job drops every per-job series; Prometheus marks them stale at the next scrape.
    wait_until_absent(prometheus.url, '{job_id="scrape-1"}')
    assert query(prometheus.url, f'lattice_job_step{{job_id="{EXAMPLE_JOB}"}}'), "other jobs stay"
