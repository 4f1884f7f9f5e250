"""workers.engine_imports: warming the engine's imports in the background, the callback a hot spare
uses to count itself warm only once they are done, and a warm process's idle priority until claimed."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from workers import engine_imports
from workers.engine_imports import import_callable, may_raise_priority, warm_imports


def test_the_callback_runs_once_every_module_is_imported_even_past_a_failing_one() -> None:
    sys.modules.pop("colorsys", None)
    seen: list[bool] = []
    thread = warm_imports(("no_such_module_of_lattice", "colorsys"), on_done=lambda: seen.append(
        "colorsys" in sys.modules))
    thread.join(30)
    assert not thread.is_alive() and seen == [True]


def test_a_train_fn_path_names_module_and_function() -> None:
    assert import_callable("os.path:join") is __import__("os").path.join
    with pytest.raises(ValueError, match="package.module:function"):
        import_callable("os.path.join")


def _policy(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.sched_getscheduler(thread.native_id)


@pytest.mark.skipif(not may_raise_priority(), reason="this process may not undo SCHED_IDLE")
def test_a_warm_process_imports_at_idle_priority_until_an_actor_claims_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    thread = warm_imports(("colorsys",), on_done=lambda: gate.wait(30), idle=True)
    try:
        assert _policy(thread) == os.SCHED_IDLE
        monkeypatch.setattr(engine_imports, "_preloading", thread)
        engine_imports.claim()
        assert _policy(thread) == os.SCHED_OTHER
    finally:
        gate.set()
        thread.join(30)
    engine_imports.claim()  # a preload that has ended: nothing to do, nothing raised


def test_imports_not_asked_to_idle_run_at_normal_priority() -> None:
    gate = threading.Event()
    thread = warm_imports(("colorsys",), on_done=lambda: gate.wait(30))
    try:
        assert _policy(thread) == os.SCHED_OTHER
    finally:
        gate.set()
        thread.join(30)


def test_claiming_a_preload_that_was_never_made_idle_changes_no_policy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the hook could not set SCHED_IDLE (no permission, not Linux) `claim` must not touch the
    scheduler: on a platform without os.SCHED_OTHER it would raise in the rank's constructor."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(engine_imports, "_set_policy",
                        lambda tid, policy: calls.append((tid, policy)) or True)
    monkeypatch.delattr(os, "SCHED_OTHER", raising=False)
    gate = threading.Event()
    thread = warm_imports(("colorsys",), on_done=lambda: gate.wait(30))
    try:
        monkeypatch.setattr(engine_imports, "_preloading", thread)
        engine_imports.claim()
        assert thread.is_alive() and calls == []
    finally:
        gate.set()
        thread.join(30)


def _imported_after(code: str) -> set[str]:
    """The modules of interest a fresh interpreter holds after running `code`."""
    import subprocess

    probe = ("import sys\n" + code + "\nprint(' '.join(m for m in ('torch.distributed.pipelining', "
             "'torch._dynamo', 'training.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    return set(out.stdout.split())


def test_a_rank_without_pp_never_imports_the_pipeline_engine_a_warm_process_does() -> None:
    # torch's pipelining brings torch._dynamo (~0.7 s of a core): a new job's ranks import the engine
    # without it; a warm process's preload (replacements, spares) imports it ahead of need.
    assert _imported_after("import " + ", ".join(engine_imports.WARM_MODULES)) == {"training.train"}
    preloaded = _imported_after("from workers import engine_imports as e\ne.preload()\n"
                                "e._preloading.join(120)")
    assert {"torch.distributed.pipelining", "torch._dynamo", "training.train"} <= preloaded


@pytest.mark.parametrize(("env", "pipeline"), [(engine_imports.rank_env({}, 1), False),
                                               (engine_imports.rank_env({}, 4), True), ({}, True)])
def test_the_setup_hook_imports_the_pipeline_engine_unless_the_job_has_no_stages(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], pipeline: bool) -> None:
    asked: list[tuple[str, ...]] = []
    monkeypatch.delenv(engine_imports.PRELOAD_PIPELINE_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(engine_imports, "warm_imports", lambda modules, **kw: asked.append(modules))
    monkeypatch.setattr(engine_imports, "_preloading", None)
    engine_imports.preload()
    assert asked == [engine_imports.WARM_MODULES + (engine_imports.PIPELINE_MODULES if pipeline else ())]
