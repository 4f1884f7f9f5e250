"""Two API replicas (`Runtime(role="api")`, each its own uvicorn server) on one database (SQLite and
PostgreSQL): a job submitted through one is read, cancelled and watched through the other; one
Idempotency-Key sent 20 times at once through both makes one job; neither replica touches Ray; the
cluster view names the elected scheduler from its lease."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session, sessionmaker

from service.auth import create_token
from service.runtime import Runtime
from service.scheduler.leader import LeaderElector
from service.settings import Settings
from service.store.models import Job
from tests.api.specs import tiny


def _no_ray(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("an API replica touched Ray")


@pytest.fixture
def replicas(
    db_url: str, db_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    import workers.client
    import workers.cluster

    monkeypatch.setattr(Runtime, "_start_ray", _no_ray)
    for name in ("start_embedded_cluster", "connect"):
        monkeypatch.setattr(workers.cluster, name, _no_ray)
    for name in ("live_topology", "find_controller", "start_controller", "controller_job_ids"):
        monkeypatch.setattr(workers.client, name, _no_ray)
    runtimes: list[Runtime] = []
    urls: list[str] = []
    try:
        for i in range(2):
            settings = Settings(home=tmp_path / f"api-{i}", database_url=db_url, rate_limit_per_s=0,
                                max_inflight_requests=0)
            rt = Runtime(settings, role="api")
            runtimes.append(rt)
            rt.start()
            assert rt.scheduler is None and rt.cluster is None
            urls.append(rt.serve_in_thread(port=0))
        yield urls
    finally:
        for rt in runtimes:
            rt.stop()


@pytest.fixture
def token(db_session_factory: sessionmaker[Session]) -> str:
    with db_session_factory() as s:
        made = create_token(s, tenant="team-a", admin=True)
        s.commit()
    return made


def test_a_job_submitted_through_one_replica_is_read_cancelled_and_watched_through_the_other(
    replicas: list[str], token: str
) -> None:
    one, other = (httpx.Client(base_url=u, headers={"Authorization": f"Bearer {token}"}, timeout=30)
                  for u in replicas)
    r = one.post("/v1/jobs", json=tiny(name="replicated"))
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    got = other.get(f"/v1/jobs/{job_id}")
    assert got.status_code == 200 and got.json()["name"] == "replicated" and got.json()["state"] == "pending"
    seen = other.get(f"/v1/jobs/{job_id}/events").json()["items"]
    assert [e["type"] for e in seen] == ["created"]
    cancelled = other.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert one.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"
    after = one.get(f"/v1/jobs/{job_id}/events", params={"after": seen[-1]["seq"]}).json()["items"]
    assert [(e["type"], e["payload"]["to"]) for e in after] == [("state", "cancelled")]


def test_one_idempotency_key_through_both_replicas_at_once_makes_one_job(
    replicas: list[str], token: str, db_session_factory: sessionmaker[Session]
) -> None:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "twice-over"}

    def submit(i: int) -> httpx.Response:
        return httpx.post(f"{replicas[i % 2]}/v1/jobs", json=tiny(name="burst"), headers=headers, timeout=60)

    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(submit, range(20)))
    assert sorted(r.status_code for r in responses) == [200] * 19 + [201], [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    with db_session_factory() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.name == "burst")) == 1


def test_the_cluster_view_of_an_api_replica_names_the_elected_scheduler(
    replicas: list[str], token: str, db_engine: Engine
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    view = httpx.get(f"{replicas[0]}/v1/cluster", headers=headers, timeout=30).json()
    assert view["source"] == "store" and view["scheduler"] == {"leader": None, "since": None, "term": 0}
    elector = LeaderElector(db_engine, holder="sched-host:4242")
    assert elector.step() == 1
    view = httpx.get(f"{replicas[1]}/v1/cluster", headers=headers, timeout=30).json()
    assert view["scheduler"]["leader"] == "sched-host:4242" and view["scheduler"]["term"] == 1
    assert view["scheduler"]["since"] is not None
    elector.stop(release=True)
    view = httpx.get(f"{replicas[0]}/v1/cluster", headers=headers, timeout=30).json()
    assert view["scheduler"]["leader"] is None and view["scheduler"]["term"] == 1
