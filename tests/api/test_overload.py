"""Graceful overload (service/api/overload.py): shedding past the in-flight bound, per-token rate
limits, and probes that are never shed."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from service.api.overload import LoadShedMiddleware, RateLimitMiddleware, TokenBuckets


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_grants_the_burst_then_says_how_long_to_wait() -> None:
    clock = FakeClock()
    buckets = TokenBuckets(rate=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token every 1/rate seconds
    assert buckets.take("b") == 0.0  # another key has its own bucket
    clock.now += 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") == pytest.approx(0.5)
    clock.now += 10.0  # refills up to the burst, not beyond
    assert [buckets.take("a") for _ in range(4)][-1] > 0


def test_token_buckets_keep_at_most_max_keys() -> None:
    buckets = TokenBuckets(rate=1.0, burst=1, max_keys=2, clock=FakeClock())
    for key in ("a", "b", "c"):
        buckets.take(key)
    assert buckets.take("a") == 0.0  # "a" was forgotten (least recently used), so it starts full
    assert buckets.take("c") > 0


def test_token_buckets_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="rate"):
        TokenBuckets(rate=0, burst=1)


def _app(gate: asyncio.Event) -> Starlette:
    async def slow(request: Request) -> JSONResponse:
        await gate.wait()
        return JSONResponse({"ok": True})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/v1/jobs", slow), Route("/healthz", healthz)])


def test_requests_past_the_bound_are_shed_at_once_and_probes_still_answer() -> None:
    async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response, httpx.Response]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_app(gate), max_inflight=3, retry_after_s=2)
        transport = httpx.ASGITransport(app=shed)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            held = [asyncio.create_task(client.get("/v1/jobs")) for _ in range(3)]
            while shed.inflight < 3:
                await asyncio.sleep(0)
            refused = await client.get("/v1/jobs")
            probe = await client.get("/healthz")
            gate.set()
            done = await asyncio.gather(*held)
            after = await client.get("/v1/jobs")
        assert shed.inflight == 0
        return done, refused, probe, after

    done, refused, probe, after = asyncio.run(scenario())
    assert [r.status_code for r in done] == [200, 200, 200]
    assert refused.status_code == 503
    assert refused.headers["retry-after"] == "2"
    assert refused.headers["content-type"] == "application/problem+json"
    assert "3 requests in flight" in refused.json()["detail"]
    assert probe.status_code == 200  # shed requests never block a probe
    assert after.status_code == 200  # the bound frees as requests finish


def test_rate_limit_is_per_token_and_exempts_probes() -> None:
    async def scenario() -> list[int]:
        gate = asyncio.Event()
        gate.set()
        limited = RateLimitMiddleware(_app(gate), rate=0.01, burst=2)
        transport = httpx.ASGITransport(app=limited)
        codes = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for token in ("one", "one", "one", "two"):
                r = await client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"})
                codes.append(r.status_code)
                if r.status_code == 429:
                    assert int(r.headers["retry-after"]) >= 1
                    assert "rate limit" in r.json()["detail"]
            codes.append((await client.get("/healthz", headers={"Authorization": "Bearer one"})).status_code)
        return codes

    assert asyncio.run(scenario()) == [200, 200, 429, 200, 200]



def test_the_service_app_limits_per_token_with_its_settings(settings, db_engine, tokens) -> None:
    """create_app installs the limits from the settings (one owner of the knobs), before auth."""
    from fastapi.testclient import TestClient

    from service.api.app import create_app
    from tests.api.conftest import bearer

    limited = settings.model_copy(update={"rate_limit_per_s": 0.001, "rate_limit_burst": 2})
    with TestClient(create_app(limited, engine=db_engine)) as client:
        codes = [client.get("/v1/jobs", headers=bearer(tokens["a"])).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        assert client.get("/v1/jobs", headers=bearer(tokens["b"])).status_code == 200  # its own bucket
        assert client.get("/healthz").status_code == 200
