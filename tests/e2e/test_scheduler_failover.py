"""Failover with real processes (bench.failover on the session's Ray cluster): one `lattice serve
--role api` and two `lattice serve --role scheduler` on a fresh PostgreSQL schema; the leader is
SIGKILLed while a DP=2 job trains. The standby takes the lease within 10 s (a functional timeout),
re-attaches to the job's detached controller (no recovery, no restart, started once) and the job
finishes with the digest of the same job trained without the service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.failover import peer_digest, run
from tests.conftest import require_postgres
from tests.e2e.conftest import wait_for_free_gpus

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.postgres]


def test_a_sigkilled_leader_scheduler_is_replaced_and_the_job_finishes_once(
    ray_cluster: Any, tmp_path: Path
) -> None:
    require_postgres()
    wait_for_free_gpus()
    result = run("postgres", tmp_path, ray_address=ray_cluster.address)
    assert result["leading_s"] < 10, result
    assert result["state"] == "succeeded", result
    assert (result["starts"], result["recovers"], result["restarts"]) == (1, 0, 0), result
    assert result["digest"] == peer_digest()
