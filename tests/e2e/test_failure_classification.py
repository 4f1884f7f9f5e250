"""Failures users can trust, through a real `lattice serve` process on the session's Ray cluster: the
job's own errors are not the hardware's. One service, three tiny DP = 2 jobs at once:

- a user's job whose token file holds ids beyond model.vocab fails as a job error in its first
  attempt, with the rank's traceback in its status and failure event, and blames no node;
- a user's job with an absurd learning rate and weight decay diverges (non-finite at the same step
  on the engine's re-run from the pre-step snapshot): "diverged, reproduced", no node blamed;
- an admin's kill_rank fault still restarts the job and makes the killed rank's node suspect;
- a hostile tenant's job, held in the queue (a quota of 0) after its token file passed the submit
  check, whose file is then replaced by a link to the service's token file: the ranks refuse the
  file they opened (outside the data root) as a job error, and never read the token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from service.auth import create_token
from tests.e2e.conftest import all_events, wait_for, wait_for_free_gpus
from tests.e2e.test_service_sigkill import Serve
from tests.faults.harness import service_job_spec
from workers.controller import kill_controller

pytestmark = pytest.mark.ray

TERMINAL = ("succeeded", "failed", "cancelled")
VOCAB = 64


def _spec(name: str, **train: Any) -> dict[str, Any]:
    spec = service_job_spec(name, steps=4, every=2, seed=5)
    spec["train"] = {**spec["train"], **train}
    return spec


class Api:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.headers = url, {"Authorization": f"Bearer {token}"}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(f"{self.url}{path}", json=body, headers=self.headers, timeout=30)
        assert r.status_code == 201, r.text
        return r.json()

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers, params=params, timeout=30)

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.get(f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return all_events(lambda after: self.get(f"/v1/jobs/{job_id}/events", after=after, limit=1000))

    def wait_done(self, job_id: str, what: str) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job["state"] in TERMINAL else None

        return wait_for(done, 300, what)


@pytest.fixture
def serve(ray_cluster: Any, tmp_path: Path) -> Iterator[Serve]:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    server = Serve(home, ray_cluster.address, tmp_path / "serve.log")
    try:
        yield server
    finally:
        server.close()


def test_job_errors_fail_at_once_blaming_no_node_while_a_killed_rank_still_blames_its_node(
    serve: Serve, tmp_path: Path
) -> None:
    wait_for_free_gpus()
    home = serve.home
    # A token file whose ids exceed model.vocab: found when the ranks read it, a DataError.
    np.arange(1000, 1000 + 4096, dtype=np.uint16).tofile(home / "data" / "bad.bin")
    serve.wait_up()
    admin = Api(serve.url, (home / "token").read_text().strip())
    engine = create_engine(f"sqlite:///{home / 'lattice.db'}")
    with Session(engine) as s:
        user = Api(serve.url, create_token(s, tenant="team-a"))
        hostile = Api(serve.url, create_token(s, tenant="team-b"))
        s.commit()
    engine.dispose()
    (np.arange(4096) % VOCAB).astype(np.uint16).tofile(home / "data" / "ok.bin")
    assert httpx.put(f"{serve.url}/v1/tenants/team-b", json={"gpu_quota": 0}, headers=admin.headers,
                     timeout=30).status_code == 200
    swapped_spec = {**_spec("swapped"), "data": {"kind": "tokens", "path": "ok.bin"}}
    swapped = hostile.post("/v1/jobs", swapped_spec)["id"]

    bad_data = {**_spec("bad-data"), "data": {"kind": "tokens", "path": "bad.bin"},
                "fault_tolerance": {"max_restarts": 5}}
    diverging = _spec("diverging", lr=10.0, weight_decay=10.0)
    killed = {**_spec("killed"), "faults": [{"kind": "kill_rank", "rank": 1, "at_step": 2}]}
    ids = [user.post("/v1/jobs", bad_data)["id"], user.post("/v1/jobs", diverging)["id"],
           admin.post("/v1/jobs", killed)["id"]]
    try:
        jobs = [admin.wait_done(i, f"job {i} to end\n{serve.tail()}") for i in ids]
        events = [admin.events(i) for i in ids]
        cluster = admin.get("/v1/cluster").json()
    finally:
        for i in ids:
            with contextlib.suppress(httpx.HTTPError, AssertionError):
                if admin.job(i)["state"] not in TERMINAL:
                    httpx.post(f"{serve.url}/v1/jobs/{i}/cancel", headers=admin.headers, timeout=30)
            kill_controller(i)
    data_job, nan_job, kill_job = jobs
    # the hostile tenant's job, held by its quota, then its checked file replaced by a link to our token
    (home / "data" / "ok.bin").unlink()
    (home / "data" / "ok.bin").symlink_to(home / "token")
    assert httpx.put(f"{serve.url}/v1/tenants/team-b", json={"gpu_quota": None}, headers=admin.headers,
                     timeout=30).status_code == 200
    try:
        swapped_job = admin.wait_done(swapped, f"job {swapped} to end\n{serve.tail()}")
        swapped_events = admin.events(swapped)
    finally:
        kill_controller(swapped)

    def story(k: int) -> str:
        return "".join(f"\n{e['seq']} {e['type']} {e['payload']}" for e in events[k]) + serve.tail()

    # the bad data: a job error in the first attempt, the traceback in the status and the event
    assert data_job["state"] == "failed" and data_job["attempt"] == 0, story(0)
    assert data_job["error"].startswith("job error: DataError: "), story(0)
    assert "Traceback (most recent call last)" in data_job["error"] and "DataError" in data_job["error"]
    failure = next(e["payload"] for e in events[0] if e["type"] == "failure")
    assert failure["classification"] == "job_error" and "DataError" in failure["traceback"]
    assert any(e["type"] == "job_error" for e in events[0])
    # the diverged run: non-finite again on the re-run of the step, the job's own failure
    assert nan_job["state"] == "failed" and nan_job["attempt"] == 0, story(1)
    assert nan_job["error"].startswith("diverged, reproduced: "), story(1)
    assert "on re-run" in nan_job["error"].splitlines()[0]
    # an injected kill is the infrastructure's: a restart, and the killed rank's node is suspect
    assert kill_job["state"] == "succeeded" and kill_job["attempt"] == 1, story(2)
    kill_failure = next(e["payload"] for e in events[2] if e["type"] == "failure")
    assert kill_failure["classification"] == "infrastructure", story(2)
    suspects = [e["payload"]["node"] for e in events[2] if e["type"] == "node_suspect"]
    assert suspects == kill_failure["failure"]["nodes"] and len(suspects) == 1, story(2)
    # no node blamed by the job errors: the only node that left `ready` is the killed rank's
    for k in (0, 1):
        assert not {"node_suspect", "node_quarantined", "attributed"} & {e["type"] for e in events[k]}
    health = {n["id"]: n["health"] for n in cluster["nodes"]}
    assert {n for n, h in health.items() if h != "ready"} == set(suspects), health
    # the link swapped in after the submit check is seen on the opened file: the job's own error
    story_swapped = "".join(f"\n{e['seq']} {e['type']} {e['payload']}" for e in swapped_events) + serve.tail()
    assert swapped_job["state"] == "failed" and swapped_job["attempt"] == 0, story_swapped
    assert swapped_job["error"].startswith("job error: DataError: data.path "), story_swapped
    assert "now leads outside the data root" in swapped_job["error"], story_swapped
    assert (home / "token").read_text().strip() not in swapped_job["error"] + story_swapped
    assert not {"node_suspect", "node_quarantined", "attributed"} & {e["type"] for e in swapped_events}
    health = {n["id"]: n["health"] for n in admin.get("/v1/cluster").json()["nodes"]}
    assert {n for n, h in health.items() if h != "ready"} == set(suspects), health
