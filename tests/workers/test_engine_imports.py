"""workers.engine_imports: warming the engine's imports in the background, and the callback a hot
spare uses to count itself warm only once they are done."""

from __future__ import annotations

import sys

import pytest

from workers.engine_imports import import_callable, warm_imports


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
