"""Graceful overload (service/api/overload.py): shedding past the in-flight bound and on the measured
or expected wait for a worker slot, per-token rate limits, and probes that are never shed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import anyio.to_thread
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
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


def _gated_app(gate: asyncio.Event) -> Starlette:
    """/v1/jobs waits for the gate; /v1/stream answers at once and then streams until the gate opens."""
    async def slow(request: Request) -> JSONResponse:
        await gate.wait()
        return JSONResponse({"ok": True})

    async def stream(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"first\n"
            await gate.wait()
            yield b"last\n"

        return StreamingResponse(body())

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/jobs", slow), Route("/v1/stream", stream), Route("/healthz", healthz)]
    return Starlette(routes=routes)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0)


def test_a_request_that_has_waited_past_the_bound_for_a_slot_sheds_new_ones_at_once() -> None:
    """One slot, held: the next request queues; once the oldest waiter has waited past the bound (a
    fake clock), a new one gets 503 at once; probes answer throughout; the queued one then runs."""
    clock = FakeClock()

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response, LoadShedMiddleware]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_gated_app(gate), max_inflight=100, concurrency=1, max_queue_wait_s=30,
                                  retry_after_s=2, clock=clock)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shed), base_url="http://t") as client:
            first = asyncio.create_task(client.get("/v1/jobs"))
            await _until(lambda: shed.running == 1)
            queued = asyncio.create_task(client.get("/v1/jobs"))
            await _until(lambda: shed.queued == 1)
            clock.now += 31  # the waiter has now waited past the 30 s bound
            refused = await client.get("/v1/jobs")
            probe = await client.get("/healthz")
            gate.set()
            done = [await first, await queued]
        return done, refused, probe, shed

    done, refused, probe, shed = asyncio.run(scenario())
    assert [r.status_code for r in done] == [200, 200]  # the queued request got the slot handed over
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert "oldest request waiting for a worker has waited 31000 ms" in refused.json()["detail"]
    assert probe.status_code == 200
    assert (shed.inflight, shed.running, shed.queued) == (0, 0, 0)


def test_a_burst_that_arrives_at_once_queues_up_to_the_in_flight_bound() -> None:
    """One slot and room for four in all: of six requests arriving together, one runs, three queue
    (none has waited yet) and two are refused at once; the queued ones run in turn."""
    async def scenario() -> list[int]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_gated_app(gate), max_inflight=4, concurrency=1, max_queue_wait_s=30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shed), base_url="http://t") as client:
            burst = [asyncio.create_task(client.get("/v1/jobs")) for _ in range(6)]
            await _until(lambda: sum(t.done() for t in burst) == 2)
            assert (shed.running, shed.queued) == (1, 3)
            gate.set()
            return sorted([(await t).status_code for t in burst])

    assert asyncio.run(scenario()) == [200, 200, 200, 200, 503, 503]


def test_no_in_flight_bound_means_nothing_is_shed_and_requests_queue_for_a_slot() -> None:
    """max_inflight 0 (LATTICE_MAX_INFLIGHT_REQUESTS=0): the slots still bound what runs at once,
    but a request waits for one however long the queue is (a fake clock says hours)."""
    clock = FakeClock()

    async def scenario() -> list[int]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_gated_app(gate), max_inflight=0, concurrency=1, max_queue_wait_s=0.001,
                                  clock=clock)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shed), base_url="http://t") as client:
            burst = [asyncio.create_task(client.get("/v1/jobs")) for _ in range(5)]
            await _until(lambda: (shed.running, shed.queued) == (1, 4))
            clock.now += 3600
            late = asyncio.create_task(client.get("/v1/jobs"))
            await _until(lambda: shed.queued == 5)
            await asyncio.sleep(0.05)  # well past the 1 ms bound in real time too: still queued
            assert shed.queued == 5
            gate.set()
            return [(await t).status_code for t in [*burst, late]]

    assert asyncio.run(scenario()) == [200] * 6


def test_a_queued_request_that_gets_no_slot_in_time_is_refused_and_leaves_the_queue() -> None:
    async def scenario() -> tuple[httpx.Response, LoadShedMiddleware]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_gated_app(gate), max_inflight=100, concurrency=1, max_queue_wait_s=0.01)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shed), base_url="http://t") as client:
            first = asyncio.create_task(client.get("/v1/jobs"))
            await _until(lambda: shed.running == 1)
            timed_out = await client.get("/v1/jobs")  # the slot stays held: it gives up waiting
            assert shed.queued == 0
            gate.set()
            assert (await first).status_code == 200
        return timed_out, shed

    timed_out, shed = asyncio.run(scenario())
    assert timed_out.status_code == 503 and "retry-after" in timed_out.headers
    assert "no worker became free" in timed_out.json()["detail"]
    assert (shed.inflight, shed.running) == (0, 0)


def test_a_streaming_response_gives_its_slot_back_when_it_starts() -> None:
    """A followed log streams for as long as the job runs: it must not hold a slot meanwhile."""
    async def scenario() -> tuple[bytes, int]:
        gate = asyncio.Event()
        shed = LoadShedMiddleware(_gated_app(gate), max_inflight=100, concurrency=1, max_queue_wait_s=30)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shed), base_url="http://t") as client:
            streaming = asyncio.create_task(client.get("/v1/stream"))
            await _until(lambda: shed.inflight == 1 and shed.running == 0)
            gate.set()  # lets /v1/jobs answer at once, and the stream end
            other = await client.get("/v1/jobs")
            return (await streaming).content, other.status_code

    assert asyncio.run(scenario()) == (b"first\nlast\n", 200)


def test_the_service_sheds_a_burst_when_its_worker_threads_are_busy(settings, db_engine) -> None:
    """create_app sizes the thread pool from the settings; with one API thread held by a slow sync
    handler, a burst gets 503 + Retry-After instead of waiting for it, and /healthz still answers."""
    from service.api.app import create_app

    tiny = settings.model_copy(update={"api_threads": 1, "max_queue_wait_ms": 20.0, "rate_limit_per_s": 0})
    app = create_app(tiny, engine=db_engine)
    release = threading.Event()
    entered = threading.Event()

    def slow() -> dict[str, bool]:  # a sync route: it runs on a worker thread
        entered.set()
        release.wait(30)
        return {"ok": True}

    app.add_api_route("/v1/slow", slow)

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], httpx.Response, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            held = asyncio.create_task(client.get("/v1/slow"))
            await _until(entered.is_set)
            burst = await asyncio.gather(*(client.get("/v1/slow") for _ in range(8)))
            probe = await client.get("/healthz")
            tokens = anyio.to_thread.current_default_thread_limiter().total_tokens
            release.set()
            return await held, burst, probe, tokens

    try:
        held, burst, probe, tokens = asyncio.run(scenario())
    finally:
        release.set()
    assert held.status_code == 200
    assert {r.status_code for r in burst} == {503}
    assert all(int(r.headers["retry-after"]) >= 1 for r in burst)
    assert all(r.headers["content-type"] == "application/problem+json" for r in burst)
    assert probe.status_code == 200
    assert tokens == tiny.api_thread_tokens  # the thread pool follows the settings, not anyio's 40
