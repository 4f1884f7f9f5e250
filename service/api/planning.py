"""Planning off the API's event loop and threads: a bounded process pool with a CPU budget per search.

A plan search is pure CPU in Python: run on the event loop or in a worker thread it holds the GIL and
stalls every other request (40 huge plans at once once made `/healthz` take 6 s). Here it runs in one
of `LATTICE_PLAN_WORKERS` processes (a `ProcessPoolExecutor`, spawned, shared by every app of this
process with the same size), with at most `8 x workers` searches admitted at once (more: 503 with
Retry-After, at once). Each search gets `LATTICE_PLAN_CPU_BUDGET_S` seconds of CPU: the worker arms
an `ITIMER_PROF` timer (process CPU time, user + system) whose SIGPROF aborts the search; the caller
then answers 422 "search too large, narrow it with ..." naming the layout fields to pin. The planner
itself (service.planner) stays pure and knows nothing of processes or budgets.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from types import FrameType
from typing import Any

from service.errors import LatticeError, ServiceUnavailable
from service.settings import Settings

log = logging.getLogger(__name__)

PENDING_PER_WORKER = 8  # searches admitted per worker process (running + queued) before 503
# Layout fields that narrow a search when pinned, most effective first.
PIN_FIELDS = ("tp", "pp", "dp", "cp", "ep", "zero_stage", "micro_batch_size", "num_microbatches", "schedule")


class SearchTooLarge(LatticeError):
    status = 422
    title = "Search too large"


class PlanningBusy(ServiceUnavailable):
    title = "Planning at capacity"
    retry_after_s = 1


class CpuBudgetExceeded(Exception):
    """Raised inside a pool worker by SIGPROF when the search used its CPU budget."""


def search_too_large(budget_s: float, given: Iterable[str] = (), prefix: str = "layout") -> SearchTooLarge:
    """The 422 for a search over budget: names the layout fields not yet pinned."""
    free = [f for f in PIN_FIELDS if f not in set(given)] or list(PIN_FIELDS)
    names = [f"{prefix}.{f}" for f in free]
    detail = (f"search too large for the planner's CPU budget of {budget_s:g} s; narrow it with "
              f"{', '.join(names)} (pin some of them), or plan for fewer GPUs")
    errors = [{"field": n, "message": "pin it to narrow the search"} for n in names]
    return SearchTooLarge(detail, errors=errors)


# ---- in the worker process ------------------------------------------------------------------------
def _on_cpu_budget(signum: int, frame: FrameType | None) -> None:
    raise CpuBudgetExceeded


def _warm() -> None:
    """Pool initializer: import the planner once, so a request's budget pays for its search only."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the service, which shuts the pool
    import service.planner  # noqa: F401


def run_budgeted(budget_s: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, fn(*args)) or (False, None) once `fn` used `budget_s` of this process's CPU time."""
    previous = signal.signal(signal.SIGPROF, _on_cpu_budget)
    signal.setitimer(signal.ITIMER_PROF, budget_s)
    try:
        return True, fn(*args)
    except CpuBudgetExceeded:
        return False, None
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


# ---- in the API process ---------------------------------------------------------------------------
_executors: dict[int, ProcessPoolExecutor] = {}
_executors_lock = threading.Lock()


def _executor(workers: int) -> ProcessPoolExecutor:
    with _executors_lock:
        pool = _executors.get(workers)
        if pool is None:
            pool = ProcessPoolExecutor(
                max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=_warm
            )
            _executors[workers] = pool
        return pool


def _discard(workers: int, pool: ProcessPoolExecutor) -> None:
    with _executors_lock:
        if _executors.get(workers) is pool:
            del _executors[workers]
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown_pools() -> None:
    with _executors_lock:
        pools = list(_executors.values())
        _executors.clear()
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)


class PlanPool:
    """Run a planner call in a worker process under a CPU budget; bounded admission."""

    def __init__(self, workers: int, cpu_budget_s: float, max_pending: int | None = None) -> None:
        self.workers = workers
        self.cpu_budget_s = cpu_budget_s
        self.max_pending = max_pending or workers * PENDING_PER_WORKER
        self.wall_timeout_s = 30.0 + 20 * cpu_budget_s  # a starved worker still answers in time
        self._pending = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> PlanPool:
        return cls(settings.plan_workers, settings.plan_cpu_budget_s)

    def _admit(self) -> None:
        with self._lock:
            if self._pending >= self.max_pending:
                raise PlanningBusy(f"{self._pending} plan searches are running or queued (the bound); "
                                   "retry in a few seconds")
            self._pending += 1

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> tuple[ProcessPoolExecutor, Future[Any]]:
        pool = _executor(self.workers)
        try:
            return pool, pool.submit(run_budgeted, self.cpu_budget_s, fn, args)
        except (BrokenProcessPool, RuntimeError) as e:  # broken, or shut down under us
            _discard(self.workers, pool)
            raise PlanningBusy("the planning pool is restarting; retry") from e

    def _outcome(self, done: tuple[bool, Any]) -> Any:
        ok, value = done
        if not ok:
            raise CpuBudgetExceeded(self.cpu_budget_s)
        return value

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker process; CpuBudgetExceeded over budget, PlanningBusy at the bound."""
        self._admit()
        try:
            pool, future = self._submit(fn, args)
            try:
                done = await asyncio.wait_for(asyncio.wrap_future(future), self.wall_timeout_s)
            except BrokenProcessPool as e:
                _discard(self.workers, pool)
                raise PlanningBusy("a planning worker died; retry") from e
            except TimeoutError as e:
                raise PlanningBusy(f"planning took over {self.wall_timeout_s:g} s of wall time; retry") from e
            return self._outcome(done)
        finally:
            self._release()

    def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """As `run`, from a worker thread (a sync route)."""
        self._admit()
        try:
            pool, future = self._submit(fn, args)
            try:
                done = future.result(self.wall_timeout_s)
            except BrokenProcessPool as e:
                _discard(self.workers, pool)
                raise PlanningBusy("a planning worker died; retry") from e
            except TimeoutError as e:
                raise PlanningBusy(f"planning took over {self.wall_timeout_s:g} s of wall time; retry") from e
            return self._outcome(done)
        finally:
            self._release()


_default_pool: PlanPool | None = None


def plan_pool_for(state: Any) -> PlanPool:
    """The app's pool (`app.state.plan_pool`), or one from the default settings for a bare router."""
    global _default_pool
    pool = getattr(state, "plan_pool", None)
    if pool is not None:
        return pool
    if _default_pool is None:
        from service.settings import get_settings

        _default_pool = PlanPool.from_settings(get_settings())
    return _default_pool
