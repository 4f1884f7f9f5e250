"""The controller folds the ranks' first-step memory accounts into the job's progress and emits one
`memory` event once every rank has reported (workers.controller.ingest)."""

from __future__ import annotations

from types import SimpleNamespace

from workers.controller.ingest import _on_memory
from workers.events import EventKind


def test_memory_accounts_fold_into_progress_and_one_event() -> None:
    emitted: list[tuple] = []
    c = SimpleNamespace(job=SimpleNamespace(progress={}),
                        run_cfg=SimpleNamespace(layout=SimpleNamespace(world_size=2)),
                        log=SimpleNamespace(emit=lambda kind, msg, **data: emitted.append((kind, data))))
    _on_memory(c, 0, {"params": 10, "grads": 10, "optimizer": 40, "activations": 7, "peak_allocated": None})
    assert emitted == []  # rank 1 has not reported yet
    _on_memory(c, 1, {"params": 12, "grads": 10, "optimizer": 30, "activations": 9, "peak_allocated": None})
    doc = c.job.progress["memory"]
    assert doc["measured"] == {"params": 12, "grads": 10, "optimizer": 40, "activations": 9}
    assert sorted(doc["ranks"]) == ["0", "1"]
    assert [k for k, _ in emitted] == [EventKind.MEMORY] and emitted[0][1]["optimizer"] == 40
    _on_memory(c, 1, {"params": 12, "grads": 10, "optimizer": 30, "activations": 9})  # a re-report
    assert len(emitted) == 1
