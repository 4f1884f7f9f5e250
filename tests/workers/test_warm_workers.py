"""Warm worker processes (workers.warm_workers): how many each node is asked for and when, with a fake
raylet that keeps the node's idle processes and a fake clock (pure logic); the runtime env names Ray's
setup hook as Ray reads it. tests/workers/test_raylets.py runs the same against real raylets."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection, Mapping
from typing import Any

import pytest

from workers.engine_imports import SETUP_HOOK
from workers.raylets import NodeGone
from workers.warm_workers import SETUP_HOOK_ENV_VAR, WarmWorkers, rank_runtime_env

ENV = rank_runtime_env({"OMP_NUM_THREADS": "1"})
OTHER = rank_runtime_env({"OMP_NUM_THREADS": "2"})


def _key(env: Mapping[str, Any]) -> str:
    return repr(sorted(env["env_vars"].items()))


class Raylets:
    """One Ray job's idle processes per node, each with its runtime env."""

    def __init__(self, fail: set[str] | None = None, start_at_most: int | None = None) -> None:
        self.idle_procs: dict[str, dict[int, str]] = {}  # node -> {pid: runtime env key}
        self.pids = itertools.count(100)
        self.started: list[tuple[str, int, float]] = []  # (node, count, keep-alive) per prestart
        self.drained: list[tuple[str, int]] = []
        self.fail = fail or set()
        self.gone: set[str] = set()
        self.start_at_most = start_at_most

    def idle(self, node: str) -> set[int]:
        if node in self.gone:
            raise NodeGone("not an alive node")
        if node in self.fail:
            raise ConnectionError("raylet unreachable")
        return set(self.idle_procs.get(node, {}))

    def prestart(self, node: str, count: int, runtime_env: Mapping[str, Any], keep_alive_s: float,
                 before: Collection[int]) -> set[int]:
        assert runtime_env["env_vars"][SETUP_HOOK_ENV_VAR] == SETUP_HOOK
        assert set(before) == self.idle(node)
        self.started.append((node, count, keep_alive_s))
        new = {next(self.pids) for _ in range(min(count, self.start_at_most or count))}
        self.idle_procs.setdefault(node, {}).update(dict.fromkeys(new, _key(runtime_env)))
        return new

    def drain(self, node: str, count: int, runtime_env: Mapping[str, Any]) -> set[int]:
        self.drained.append((node, count))
        return {self.take(node, runtime_env) for _ in range(count)} - {None}

    # ---- what else happens on a node ----------------------------------------------------------------
    def add(self, node: str, env: Mapping[str, Any]) -> int:
        pid = next(self.pids)
        self.idle_procs.setdefault(node, {})[pid] = _key(env)
        return pid

    def take(self, node: str, env: Mapping[str, Any] = ENV) -> Any:
        """An actor created with `env` takes an idle process of that env (a replacement rank)."""
        procs = self.idle_procs.get(node, {})
        pid = next((p for p in sorted(procs) if procs[p] == _key(env)), None)
        procs.pop(pid, None)
        return pid

    def count(self, node: str) -> int:
        return len(self.idle_procs.get(node, {}))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _warm(per_node: int = 1, **raylets_kw: Any) -> tuple[WarmWorkers, Raylets, Clock]:
    raylets, clock = Raylets(**raylets_kw), Clock()
    warm = WarmWorkers(ENV, per_node, keep_alive_s=600.0, check_s=60.0, raylets=raylets, clock=clock,
                       background=False)
    return warm, raylets, clock


def test_runtime_env_carries_the_jobs_environment_and_rays_setup_hook() -> None:
    from ray._private import ray_constants

    env = rank_runtime_env({"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO"})
    assert SETUP_HOOK_ENV_VAR == ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    assert env == {"env_vars": {"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO", SETUP_HOOK_ENV_VAR: SETUP_HOOK}}


def test_a_long_job_keeps_one_process_per_node_not_one_more_each_renewal() -> None:
    """The defect this replaced: every renewal started a new process without looking, so a job that
    ran for hours piled one more idle process onto each node every 9 minutes."""
    warm, raylets, clock = _warm()
    assert warm.keep({"b", "a"}) == ["a", "b"]
    assert raylets.started == [("a", 1, 600.0), ("b", 1, 600.0)]
    for _ in range(600):  # ten hours of checks, every minute
        clock.t += 60.0
        warm.keep({"a", "b"})
    assert raylets.count("a") == raylets.count("b") == 1
    assert len(raylets.started) == 2
    assert warm.describe() == {"a": 1, "b": 1}  # what GET /metrics shows (lattice_warm_processes)


def test_a_process_taken_or_reaped_is_replaced_by_one() -> None:
    warm, raylets, clock = _warm()
    warm.keep({"a", "b"})
    clock.t = 10.0
    assert warm.keep({"a", "b"}) == []  # not due: nothing changed, last check 10 s ago
    raylets.take("a")  # a replacement rank started in a's process
    warm.taken({"a"})
    assert warm.keep({"a", "b"}) == ["a", "b"]
    assert raylets.started[-1] == ("a", 1, 600.0) and raylets.count("a") == 1
    raylets.idle_procs["b"].clear()  # b's keep-alive ran out and the raylet reaped it
    clock.t = 75.0
    warm.keep({"a", "b"})
    assert raylets.started[-1] == ("b", 1, 600.0) and len(raylets.started) == 4
    assert raylets.count("a") == raylets.count("b") == 1


def test_other_processes_on_the_node_are_not_counted_as_the_jobs() -> None:
    """Another job's idle process (same Ray job, other runtime env) does not stand in for this one's."""
    warm, raylets, _ = _warm()
    raylets.add("a", OTHER)
    warm.keep({"a"})
    assert raylets.started == [("a", 1, 600.0)] and raylets.count("a") == 2


def test_standby_nodes_get_one_process_per_rank_that_would_move_there() -> None:
    """workers.relocate.standby_nodes: a node where a lost node's TP pair would land keeps two; a job
    node that is also a standby keeps the larger count; fewer wanted, or none, ends the rest."""
    warm, raylets, clock = _warm()
    warm.keep({"a", "b"}, {"c": 2, "b": 2})
    assert raylets.started == [("a", 1, 600.0), ("b", 2, 600.0), ("c", 2, 600.0)]
    assert warm.keep({"a", "b"}, {"c": 2, "b": 2}) == []
    warm.keep({"a", "b"}, {"c": 4})  # a bigger group would now land on c; b is a job node only
    assert raylets.started[-1] == ("c", 2, 600.0) and raylets.count("c") == 4
    assert raylets.drained == [("b", 1)] and raylets.count("b") == 1
    warm.keep({"a", "b"}, {"d": 1})  # c is no standby node any more
    assert raylets.count("c") == 0 and raylets.count("d") == 1
    assert sorted(warm.mine) == ["a", "b", "d"]


def test_release_ends_every_process_the_job_kept() -> None:
    warm, raylets, _ = _warm()
    warm.keep({"a", "b"}, {"c": 2})
    raylets.add("a", OTHER)
    warm.release()
    assert (raylets.count("a"), raylets.count("b"), raylets.count("c")) == (1, 0, 0)  # OTHER's stays
    assert warm.mine == {} and warm.describe() == {}
    assert warm.keep({"a", "b"}) == ["a", "b"]  # a job that is started again keeps them again


def test_a_failed_raylet_call_is_logged_not_raised_and_not_retried_every_check(
        caplog: pytest.LogCaptureFixture) -> None:
    warm, raylets, clock = _warm(fail={"a"})
    warm.keep({"a", "b"})
    assert "warm worker processes on node a: ConnectionError: raylet unreachable" in caplog.text
    assert "node b" not in caplog.text and raylets.count("b") == 1
    raylets.fail.clear()
    clock.t = 61.0
    warm.keep({"a", "b"})  # reachable again, but backed off for the keep-alive: no pile-up on a bad node
    assert [n for n, _, _ in raylets.started] == ["b"]
    clock.t = 601.0
    warm.keep({"a", "b"})
    assert [n for n, _, _ in raylets.started] == ["b", "a"]


def test_a_lost_node_is_forgotten_and_a_failure_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    warm, raylets, clock = _warm()
    warm.keep({"a", "b"})
    raylets.gone.add("b")  # b died with its process; the job's ranks moved off it
    raylets.idle_procs.pop("b")
    clock.t = 61.0
    warm.keep({"a"})
    assert sorted(warm.mine) == ["a"]
    raylets.fail.add("a")
    for _ in range(5):
        clock.t += 61.0
        warm.keep({"a"})
    assert caplog.text.count("on node a: ConnectionError") == 1
    assert caplog.text.count("on node b: not an alive node") == 1
    assert warm.mine == {"a": {100}}  # a's process is still counted as the job's


def test_a_node_that_starts_fewer_than_asked_is_not_asked_each_check(
        caplog: pytest.LogCaptureFixture) -> None:
    """Processes that register after the wait are not the job's as far as it knows: asking again at
    every check would add one each time."""
    warm, raylets, clock = _warm(per_node=2, start_at_most=1)
    warm.keep({"a"})
    assert "2 process(es) asked, 1 registered in time" in caplog.text
    for _ in range(5):
        clock.t += 60.0
        warm.keep({"a"})
    assert raylets.started == [("a", 2, 600.0)] and raylets.count("a") == 1


def test_the_raylet_calls_run_off_the_callers_thread_and_the_newest_request_wins() -> None:
    """An unreachable raylet (RPC timeouts of seconds) must not hold up the controller's loop."""
    raylets = Raylets()
    started, go = threading.Event(), threading.Event()
    calls: list[str] = []
    idle = raylets.idle

    def slow_idle(node: str) -> set[int]:
        calls.append(node)
        started.set()
        go.wait(10)
        return idle(node)

    raylets.idle = slow_idle  # type: ignore[method-assign]
    clock = Clock()
    warm = WarmWorkers(ENV, 1, raylets=raylets, clock=clock)
    assert warm.keep({"a"}) == ["a"]  # returned while the call is still blocked
    assert started.wait(10)
    warm.keep({"b"})  # both queued behind the blocked check: only the newer one runs
    warm.keep({"c"})
    go.set()
    assert warm.settle(10)
    assert calls[0] == "a" and "b" not in calls and "c" in calls
    assert (raylets.count("a"), raylets.count("c")) == (0, 1)  # a is no node of the job's any more
    warm.release()
    assert raylets.count("c") == 0


def test_none_are_kept_when_switched_off() -> None:
    warm, raylets, _ = _warm(per_node=0)
    assert warm.keep({"a"}) == [] and raylets.started == []
    warm, raylets, _ = _warm(per_node=2)
    warm.keep({"a"})
    assert raylets.started == [("a", 2, 600.0)]
