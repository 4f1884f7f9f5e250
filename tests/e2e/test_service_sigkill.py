"""Killing the service itself: a real `lattice serve` OS process on a SQLite file and the
session's shared Ray cluster (LATTICE_RAY_ADDRESS) runs a small DP=2 job; the test SIGKILLs that
process while the job trains (after a checkpoint is stored): no shutdown code runs, the Ray driver
dies with it. The job's detached controller and its ranks must outlive that driver, and a new
`lattice serve` on the same database and cluster must re-attach to it (no recovery, no restart)
and finish the job exactly once, with the fault-free run's model digest, no stored event lost or
stored twice, the API answering before and after."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from service.schemas import JobSpec
from tests.e2e.conftest import all_events, wait_for, wait_for_free_gpus
from tests.faults.harness import fault_free_digest, service_job_spec
from training.config.layout import Layout
from training.config.run import RunConfig
from training.parallel.dist import free_port
from workers.controller import get_controller, kill_controller

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TERMINAL = ("succeeded", "failed", "cancelled")
SEED, STEPS, EVERY, DP = 11, 24, 4, 2
# Every rank equally slow keeps the job running across the kill and the restart without making
# any rank a straggler (that would restart the ranks off their node); it does not change the maths.
SPEC: dict[str, Any] = {
    **service_job_spec("e2e-sigkill", steps=STEPS, every=EVERY, seed=SEED, dp=DP),
    "faults": [{"kind": "slow_rank", "rank": r, "at_step": 1, "seconds": 0.75} for r in range(DP)],
}


class Serve:
    """One `lattice serve` process (python -m service serve) on `home`, listening on a free port."""

    def __init__(self, home: Path, ray_address: str, log: Path) -> None:
        self.home, self.log = home, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")}
        env |= {
            "LATTICE_HOME": str(home),
            "LATTICE_RAY_ADDRESS": ray_address,
            "LATTICE_FAULT_INJECTION": "true",
            "LATTICE_SCHEDULER_INTERVAL_S": "0.3",
            "LATTICE_LOG_LEVEL": "info",
        }
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "service", "serve", "--port", str(self.port)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )

    def wait_up(self, timeout_s: float = 120.0) -> None:
        """Until /healthz answers: uvicorn serves only after the scheduler has reconciled."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"lattice serve did not come up (rc {self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.25)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


class Api:
    def __init__(self, token: str) -> None:
        self.headers = {"Authorization": f"Bearer {token}"}
        self.url = ""

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers, params=params, timeout=30)

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return all_events(lambda after: self.get(f"/v1/jobs/{job_id}/events", after=after, limit=1000))


def run_config() -> RunConfig:
    return JobSpec.model_validate(SPEC).to_run_config(Layout(dp=DP), None)


@pytest.fixture
def servers(ray_cluster: Any) -> Iterator[list[Serve]]:
    made: list[Serve] = []
    yield made
    for s in made:
        s.close()


def _controller_snapshot(job_id: str) -> dict[str, Any] | None:
    handle = get_controller(job_id)
    if handle is None:
        return None
    try:
        return ray.get(handle.poll.remote(0), timeout=30)
    except ray.exceptions.RayError:
        return None


def test_sigkilled_lattice_serve_process_restarts_and_the_job_finishes_once(
    ray_cluster: Any, tmp_path: Path, servers: list[Serve]
) -> None:
    wait_for_free_gpus()
    home = tmp_path / "home"
    job_id: str | None = None
    api: Api | None = None

    def logs() -> str:
        return "".join(f"\n--- {s.log.name} ---\n{s.tail()}" for s in servers)

    try:
        first = Serve(home, ray_cluster.address, tmp_path / "serve-1.log")
        servers.append(first)
        first.wait_up()
        token = (home / "token").read_text().strip()
        api = Api(token)
        api.url = first.url
        r = httpx.post(f"{first.url}/v1/jobs", json=SPEC, headers=api.headers, timeout=30)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]

        # SIGKILL while the job runs, once a checkpoint (and so some steps) is stored
        wait_for(lambda: any(e["type"] == "checkpoint" for e in api.events(job_id)), 240,
                 f"a stored checkpoint of job {job_id}{logs()}")
        before_job = api.job(job_id)
        before_events = api.events(job_id)
        assert before_job["state"] == "running" and 1 <= before_job["progress"]["step"] < STEPS, before_job
        first.sigkill()
        assert first.proc.returncode == -signal.SIGKILL
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{first.url}/healthz", timeout=2)
        left = _controller_snapshot(job_id)  # what the kill left of the job, for the messages below

        second = Serve(home, ray_cluster.address, tmp_path / "serve-2.log")
        servers.append(second)
        second.wait_up()
        assert (home / "token").read_text().strip() == token  # no second bootstrap token
        api.url = second.url
        after_job = api.job(job_id)  # the job row survived the kill
        assert (after_job["id"], after_job["name"], after_job["spec"]) == (job_id, SPEC["name"],
                                                                          before_job["spec"])
        job = wait_for(lambda: (lambda j: j if j["state"] in TERMINAL else None)(api.job(job_id)), 240,
                       f"job {job_id} to end after the restart{logs()}")
        events = api.events(job_id)
    finally:
        if job_id is not None and api is not None and api.url:
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                if api.job(job_id)["state"] not in TERMINAL:
                    httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=api.headers, timeout=30)
        for s in servers:
            s.close()
        if job_id is not None:
            kill_controller(job_id)  # a no-op once the service collected the finished controller
    assert job["state"] == "succeeded", f"{job['error']}{logs()}"
    assert job["result"]["model_digest"] == fault_free_digest(run_config())
    # nothing stored before the kill was lost or rewritten
    assert events[: len(before_events)] == before_events
    # picked up again: the detached controller (and its ranks) outlived the killed service's Ray
    # driver, so the new service re-attached to it; no recovery, no restart of the ranks
    types = [e["type"] for e in events]
    story = "".join(f"\n{e['seq']} {e['type']} {e['payload']}" for e in events) + logs()
    assert left is not None, f"the job's controller died with the service{story}"
    assert not left["terminal"], "the job ended before its service was killed"
    assert types.count("reattached") == 1 and "recover" not in types, story
    assert len(before_events) <= types.index("reattached") < types.index("finished")
    assert job["attempt"] == 0 and "restart" not in types, story
    assert types.count("finished") == 1
    moves = [e["payload"]["to"] for e in events if e["type"] == "state"]
    assert moves.count("succeeded") == 1 and moves[-1] == "succeeded"
    # no controller event stored twice across the kill; the store's seqs are gapless and unique
    cseqs = [e["payload"]["cseq"] for e in events if "cseq" in e["payload"]]
    assert cseqs == sorted(set(cseqs))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
