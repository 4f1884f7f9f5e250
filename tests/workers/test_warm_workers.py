"""Warm worker processes (workers.warm_workers): which nodes are asked for one and when (pure logic,
a fake raylet call and clock), and that the runtime env names Ray's setup hook as Ray reads it."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine_imports import SETUP_HOOK
from workers.warm_workers import SETUP_HOOK_ENV_VAR, WarmWorkers, rank_runtime_env


class Raylets:
    def __init__(self, fail: set[str] | None = None) -> None:
        self.calls: list[tuple[str, int, float]] = []
        self.fail = fail or set()
        self.env: dict[str, Any] | None = None

    def __call__(self, ask: Any, runtime_env: Any, keep_alive_s: float) -> dict[str, str]:
        self.calls.extend((node, count, keep_alive_s) for node, count in ask.items())
        self.env = dict(runtime_env)
        if "all" in self.fail:
            raise ConnectionError("no raylet reachable")
        return {node: "raylet unreachable" for node in ask if node in self.fail}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _warm(per_node: int = 1, fail: set[str] | None = None) -> tuple[WarmWorkers, Raylets, Clock]:
    raylets, clock = Raylets(fail), Clock()
    env = rank_runtime_env({"OMP_NUM_THREADS": "1"})
    warm = WarmWorkers(env, per_node, keep_alive_s=100.0, prestart=raylets, clock=clock, background=False)
    return warm, raylets, clock


def test_runtime_env_carries_the_jobs_environment_and_rays_setup_hook() -> None:
    from ray._private import ray_constants

    env = rank_runtime_env({"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO"})
    assert SETUP_HOOK_ENV_VAR == ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    assert env == {"env_vars": {"OMP_NUM_THREADS": "2", "NCCL_DEBUG": "INFO", SETUP_HOOK_ENV_VAR: SETUP_HOOK}}


def test_each_node_is_asked_once_until_its_process_is_taken_or_the_keep_alive_runs_out() -> None:
    warm, raylets, clock = _warm()
    assert warm.keep({"b", "a"}) == ["a", "b"]
    assert raylets.calls == [("a", 1, 100.0), ("b", 1, 100.0)]
    assert raylets.env is not None and raylets.env["env_vars"][SETUP_HOOK_ENV_VAR] == SETUP_HOOK
    clock.t = 50.0
    assert warm.keep({"a", "b", "c"}) == ["c"]  # a and b still hold theirs
    warm.taken({"a"})  # a replacement started on a
    assert warm.keep({"a", "b", "c"}) == ["a"]
    clock.t = 95.0  # b's keep-alive (asked at 0) is running out: asked again before the raylet reaps it
    assert warm.keep({"a", "b", "c"}) == ["b"]
    assert [n for n, _, _ in raylets.calls] == ["a", "b", "c", "a", "b"]


def test_a_failed_raylet_call_is_logged_not_raised_and_not_retried_in_a_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    warm, raylets, _ = _warm(fail={"a"})
    assert warm.keep({"a", "b"}) == ["a", "b"]
    assert "no warm worker process on node a: raylet unreachable" in caplog.text
    assert "node b" not in caplog.text
    assert warm.keep({"a", "b"}) == []  # not asked again on every poll
    assert len(raylets.calls) == 2
    warm, raylets, _ = _warm(fail={"all"})  # the lookup itself failed: every node logged, nothing raised
    assert warm.keep({"c"}) == ["c"]
    assert "no warm worker process on node c: no raylet reachable" in caplog.text


def test_standby_nodes_get_one_process_per_rank_that_would_move_there() -> None:
    """workers.relocate.standby_nodes: a node where a lost node's TP pair would land is asked for two;
    a job node that is also a standby gets the larger count; asked again only when it needs more."""
    warm, raylets, clock = _warm()
    assert warm.keep({"a", "b"}, {"c": 2, "b": 2}) == ["a", "b", "c"]
    assert raylets.calls == [("a", 1, 100.0), ("b", 2, 100.0), ("c", 2, 100.0)]
    clock.t = 10.0
    assert warm.keep({"a", "b"}, {"c": 2}) == []  # b holds 2 >= 1; c still holds its 2
    assert warm.keep({"a", "b"}, {"c": 4}) == ["c"]  # a bigger group would now land on c
    assert raylets.calls[-1] == ("c", 4, 100.0)


def test_the_raylet_calls_run_off_the_callers_thread() -> None:
    """An unreachable raylet (RPC timeout of seconds) must not hold up the controller's loop."""
    import threading

    started, release = threading.Event(), threading.Event()

    def slow(ask: Any, runtime_env: Any, keep_alive_s: float) -> dict[str, str]:
        started.set()
        release.wait(10)
        return {}

    warm = WarmWorkers(rank_runtime_env({}), 1, prestart=slow)
    assert warm.keep({"a"}) == ["a"]  # returned while the call is still blocked
    assert started.wait(10)
    release.set()


def test_none_are_kept_when_switched_off() -> None:
    warm, raylets, _ = _warm(per_node=0)
    assert warm.keep({"a"}) == [] and raylets.calls == []
    warm, raylets, _ = _warm(per_node=2)
    warm.keep({"a"})
    assert raylets.calls == [("a", 2, 100.0)]
