"""The real service against the session's shared Ray cluster: `Runtime` (migrations, scheduler,
FastAPI app) on a SQLite file, driven over HTTP with a TestClient. `LiveService.restart()`
stops the service (scheduler and app; the detached job controllers keep running) and starts a
new one on the same database, as a restarted `lattice serve` would."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service import store
from service.auth import create_token
from service.runtime import Runtime
from service.settings import Settings
from tests.ray_fixture import ray_cluster
from tests.waiting import wait_for
from workers.controller import kill_controller
from workers.topology import Topology

__all__ = ["LiveService", "all_events", "make_service", "ray_cluster", "wait_for"]

TERMINAL = ("succeeded", "failed", "cancelled")


def wait_for_free_gpus(n: int = 16, timeout_s: float = 60.0) -> None:
    wait_for(lambda: Topology.from_ray().gpus_free == n, timeout_s, f"{n} free GPUs")


def all_events(fetch: Callable[[int], httpx.Response]) -> list[dict[str, Any]]:
    """Every event of a job, following `next_after` (`fetch(after)` GETs one page)."""
    items: list[dict[str, Any]] = []
    after = 0
    while True:
        r = fetch(after)
        assert r.status_code == 200, r.text
        page = r.json()
        items += page["items"]
        if page["next_after"] is None:
            return items
        after = page["next_after"]


class LiveService:
    def __init__(self, settings: Settings, controller_defaults: dict[str, Any] | None = None) -> None:
        self.settings = settings
        self.controller_defaults = controller_defaults
        self.runtime: Runtime | None = None
        self.client: TestClient | None = None
        self.admin = ""
        self.user = ""
        self.start()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.runtime = Runtime(self.settings, controller_defaults=self.controller_defaults).start()
        assert self.runtime.app is not None
        if self.runtime.admin_token is not None:
            self.admin = self.runtime.admin_token
            with Session(self.runtime.engine) as s:
                self.user = create_token(s, tenant="team-a")
                s.commit()
        self.client = TestClient(self.runtime.app)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.runtime is not None:
            self.runtime.stop()
            self.runtime = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the service and end the controllers of its unfinished jobs (tests share the cluster)."""
        if self.runtime is not None and self.runtime.engine is not None:
            with Session(self.runtime.engine) as s:
                open_jobs = [j.id for j in store.list_jobs(s, limit=None) if j.state not in TERMINAL]
        else:
            open_jobs = []
        self.stop()
        for job_id in open_jobs:
            kill_controller(job_id)

    # ---- HTTP ----------------------------------------------------------------------------------
    def api(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        assert self.client is not None, "the service is stopped"
        headers = {"Authorization": f"Bearer {token or self.admin}", **kwargs.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kwargs)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        r = self.api("POST", "/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        r = self.api("GET", f"/v1/jobs/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return all_events(lambda after: self.api("GET", f"/v1/jobs/{job_id}/events",
                                                 params={"after": after, "limit": 1000}))

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout_s: float = 240) -> dict[str, Any]:
        return wait_for(lambda: (lambda j: j if j["state"] in states else None)(self.job(job_id)),
                        timeout_s, f"job {job_id} to reach {states}")

    def failures(self, job_id: str, events: list[dict[str, Any]] | None = None) -> str:
        """What went wrong in a job that should have run clean ("" when nothing did): its failure
        events, and the end of each rank's log in every attempt but the last (where a rank that
        died says why: a traceback, or a native abort's message and faulthandler's stacks)."""
        failed = [e for e in (events if events is not None else self.events(job_id))
                  if e["type"] in ("failure", "restart", "restore", "error", "job_error")]
        if not failed:
            return ""
        lines = [f"{e['type']}: {e['payload']}"[:1500] for e in failed]
        index = self.api("GET", f"/v1/jobs/{job_id}/logs/index").json()
        for attempt in index.get("attempts", [])[:-1]:
            for rank in attempt["ranks"]:
                where = {"rank": rank["rank"], "attempt": attempt["attempt"]}
                text = self.api("GET", f"/v1/jobs/{job_id}/logs", params={**where, "tail": 60}).text
                head = f"--- attempt {where['attempt']}, rank {where['rank']}:"
                if any(m in text for m in ("Fatal Python error", "terminate called", "Check failed")):
                    lines.insert(len(failed), f"{head}\n{text}")
                elif "Traceback" in text:  # a survivor that failed out of a collective: its last words
                    lines.append(f"{head} {text.rstrip().splitlines()[-1][:300]}")
        return "\n".join(lines)

    def session(self) -> Session:
        assert self.runtime is not None and self.runtime.engine is not None
        return Session(self.runtime.engine)


def make_service(ray_cluster: Any, home: Path, *, controller_defaults: dict[str, Any] | None = None,
                 **overrides: Any) -> LiveService:
    settings = Settings(
        home=home,
        database_url=f"sqlite:///{home / 'lattice.db'}",
        ray_address=ray_cluster.address,
        scheduler_interval_s=0.3,
        log_level="warning",
        **overrides,
    )
    return LiveService(settings, controller_defaults)


@pytest.fixture
def service_factory(ray_cluster: Any, tmp_path: Path) -> Iterator[Callable[..., LiveService]]:
    made: list[LiveService] = []

    def factory(**kwargs: Any) -> LiveService:
        svc = make_service(ray_cluster, tmp_path / f"home{len(made)}", **kwargs)
        made.append(svc)
        return svc

    yield factory
    for svc in made:
        svc.close()
