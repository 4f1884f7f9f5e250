"""Planning in a bounded process pool with a CPU budget per search (service/api/planning.py):
a search over budget answers 422 "search too large" naming the fields to pin, a normal plan still
works, and /healthz answers while many huge plans run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.planning import PlanningBusy, PlanPool, run_budgeted, search_too_large
from service.settings import Settings
from tests.api.conftest import bearer

DEMO = {"model": {"preset": "demo"}, "global_batch": 8,
        "cluster": {"gpu_type": "cpu-virtual", "num_gpus": 8, "gpus_per_node": 4}}
# A 96-layer, 256-expert MoE on ~1M GPUs with a batch of many divisors: the biggest search the
# request schema allows (about 0.15 s of CPU on a 2-core machine; 25k candidates).
HUGE = {
    "model": {"layers": 96, "hidden": 12288, "heads": 96, "vocab": 128000, "seq_len": 8192,
              "num_experts": 256, "top_k": 8, "expert_ffn": 2048},
    "global_batch": 2**12 * 9 * 5 * 7,
    "cluster": {"gpu_type": "H100-80GB", "num_gpus": 2**10 * 27 * 5 * 7},
    "top_k": 50,
}


def _spin(seconds: float) -> str:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return "done"


def test_run_budgeted_stops_a_search_at_its_cpu_budget() -> None:
    assert run_budgeted(5.0, _spin, (0.01,)) == (True, "done")
    assert run_budgeted(0.05, _spin, (30.0,)) == (False, None)  # aborted by SIGPROF, not after 30 s


def test_search_too_large_names_only_the_fields_not_pinned() -> None:
    problem = search_too_large(2.0, given={"pp": 24, "tp": 1})
    fields = [e["field"] for e in problem.errors or []]
    assert problem.status == 422 and "layout.dp" in fields and "layout.cp" in fields
    assert "layout.pp" not in fields and "layout.tp" not in fields
    assert "CPU budget of 2 s" in problem.detail and "layout.dp" in problem.detail


def test_the_pool_bounds_what_it_admits() -> None:
    pool = PlanPool(workers=1, cpu_budget_s=1.0, max_pending=1)

    async def two() -> list[Any]:
        return await asyncio.gather(pool.run(_spin, 0.2), pool.run(_spin, 0.2), return_exceptions=True)

    results = asyncio.run(two())
    assert sorted(type(r).__name__ for r in results) == ["PlanningBusy", "str"]
    assert any(isinstance(r, PlanningBusy) for r in results)
    assert asyncio.run(pool.run(_spin, 0.01)) == "done"  # the slot came back


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_plan_over_budget_answers_422_naming_the_fields_to_pin(settings: Settings, db_engine: Any,
                                                                 tokens: dict[str, str]) -> None:
    tight = settings.model_copy(update={"plan_cpu_budget_s": 0.03})
    with TestClient(create_app(tight, engine=db_engine)) as client:
        ok = client.post("/v1/plans", json=DEMO, headers=bearer(tokens["a"]))
        assert ok.status_code == 200, ok.text
        assert ok.json()["layout"]["tp"] >= 1
        over = client.post("/v1/plans", json=HUGE, headers=bearer(tokens["a"]))
        assert over.status_code == 422, over.text
        assert over.headers["content-type"].startswith("application/problem+json")
        problem = over.json()
        assert problem["detail"].startswith("search too large")
        fields = [e["field"] for e in problem["errors"]]
        assert {"layout.tp", "layout.pp", "layout.dp", "layout.cp"} <= set(fields)
        invalid = client.post("/v1/plans", json=DEMO | {"model": {"preset": "no-such"}},
                              headers=bearer(tokens["a"]))
        assert invalid.status_code == 422 and "no-such" in invalid.text  # planner errors still say why


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_healthz_answers_while_ten_huge_plans_run(settings: Settings, db_engine: Any,
                                                  tokens: dict[str, str]) -> None:
    app = create_app(settings, engine=db_engine)

    async def scenario() -> tuple[int, int, list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            plans = [asyncio.create_task(client.post("/v1/plans", json=HUGE, headers=bearer(tokens["a"])))
                     for _ in range(10)]
            await asyncio.sleep(0)  # let them all start
            health = await asyncio.wait_for(client.get("/healthz"), timeout=30)
            done_then = sum(p.done() for p in plans)
            answers = await asyncio.wait_for(asyncio.gather(*plans), timeout=300)
            return health.status_code, done_then, [a.status_code for a in answers]

    health, done_then, statuses = asyncio.run(scenario())
    assert health == 200
    assert done_then < 10  # /healthz did not wait for the plans
    assert statuses == [200] * 10
