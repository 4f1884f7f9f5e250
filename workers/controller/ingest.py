"""The ranks' reports of one poll, read into the controller's records: progress, checkpoint
commits, the attempt's markers and integrity error, fired faults, restores and the final result.

It works on the controller's owned collaborators, named by the `Controller` protocol (the state
machine in workers.controller.machine satisfies it), so that this module does not import it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from training.config.run import RunConfig
from workers.controller.attempt import Attempt
from workers.controller.eventlog import EventLog
from workers.controller.injection import FaultInjector
from workers.controller.records import Clocks, FaultBooks, JobRecord, Recovery
from workers.controller.scrub import CheckpointScrubber
from workers.events import CheckpointSaved, EventKind, parse_kind
from workers.worker_group import GroupStatus

log = logging.getLogger(__name__)


class Controller(Protocol):
    run_cfg: RunConfig
    clocks: Clocks
    log: EventLog
    job: JobRecord
    attempt: Attempt
    recovery: Recovery
    books: FaultBooks
    injector: FaultInjector
    scrubber: CheckpointScrubber

    def fault_stats(self) -> dict[str, Any]: ...


def ingest(c: Controller, status: GroupStatus, now: float) -> None:
    """Read every rank's events of this poll, in the order they happened (the ranks' wall clocks)."""
    merged = []
    for rank, s in status.ranks.items():
        if s.state != "unresponsive":
            c.attempt.last_seen[rank] = now
            if s.stepped:
                c.attempt.stepped.add(rank)
        merged += [(float(ev.get("t") or 0.0), rank, i, ev) for i, ev in enumerate(s.events)]
    world = len(status.ranks)
    for _, rank, _, ev in sorted(merged, key=lambda item: item[:3]):
        _read(c, rank, ev, world, now)


def _read(c: Controller, rank: int, ev: Mapping[str, Any], world: int, now: float) -> None:
    kind, attempt = parse_kind(ev.get("kind")), c.attempt
    if kind == EventKind.STEP:
        _on_step(c, rank, ev)
    elif kind == EventKind.COLLECTIVE:
        step = int(ev.get("step", 0))
        entered = ev.get("name") == "checkpoint"
        attempt.markers[rank] = (step, 2 if entered else 1)
        if not entered:
            found = c.books.straggler.arrive(step, rank, float(ev.get("t", now)))
            if found is not None and c.recovery.straggler is None:
                c.recovery.straggler = found
    elif kind == EventKind.CHECKPOINT:
        _on_checkpoint(c, rank, ev, world)
    elif kind == EventKind.VERIFIED:
        c.scrubber.ledger.mark_verified(int(ev["step"]))
    elif kind == EventKind.RESTORED and not attempt.restored_seen:
        _on_restored(c, ev.get("step"), str(ev.get("source") or "checkpoint"))
    elif kind == EventKind.INTEGRITY_ERROR and attempt.integrity is None:
        # Every rank raises the same agreed error; record it once.
        attempt.integrity = {k: ev.get(k) for k in ("error_kind", "step", "ranks", "evidence")}
        message = ev.get("message", "integrity check failed")
        c.log.emit(EventKind.INTEGRITY_ERROR, message, **attempt.integrity)
    elif kind == EventKind.FAILED:
        # The exception that ended the rank's training: type, message, where, traceback (classify).
        attempt.errors[rank] = {k: ev.get(k) for k in ("error", "error_types", "origin", "step", "traceback")}
    elif kind == EventKind.FAULT_INJECTED:
        c.injector.fired(rank, ev, attempt.rank_node.get(rank))
    elif kind == EventKind.VALIDATION and rank == 0:  # the same loss on every rank: report it once
        step, loss = ev.get("step"), ev.get("loss")
        c.job.progress.update(val_loss=loss, val_step=step)
        c.log.emit(EventKind.VALIDATION, f"validation loss {loss} after step {step}", step=step, loss=loss)
    elif kind == EventKind.GRADIENT_SPIKE and rank == 0:  # agreed: the same on every rank
        c.log.emit(EventKind.GRADIENT_SPIKE, f"{ev.get('error_kind')} at step {ev.get('step')} on rank(s) "
                   f"{ev.get('ranks')} reproduced exactly on the re-run: the data's, not the hardware's; "
                   "training goes on", **{k: ev.get(k) for k in ("error_kind", "step", "ranks", "evidence")})
    elif kind == EventKind.GRADIENT_RERUN and rank == 0:  # agreed: the same on every rank
        _on_gradient_rerun(c, ev)
    elif kind == EventKind.STARTED and rank == 0:
        c.log.emit(EventKind.RENDEZVOUS, f"process group up ({ev.get('backend')} on {ev.get('device')})",
                   backend=ev.get("backend"), device=ev.get("device"))


def _on_gradient_rerun(c: Controller, ev: Mapping[str, Any]) -> None:
    """A restart re-ran a step whose gradient spike failed an earlier attempt (training.integrity.settle)."""
    step, same, changed = int(ev.get("step", 0)), list(ev.get("same") or []), list(ev.get("changed") or [])
    if changed:
        c.recovery.transients.append((step, changed))
        why = f"rank(s) {changed} computed other norms now: a transient fault in the earlier attempt"
    else:
        why = "the same norms to the bit: the data's, not the hardware's"
    c.log.emit(EventKind.GRADIENT_RERUN, f"step {step}'s gradient spike re-run by the restart: {why}",
               step=step, same=same, changed=changed)


def _on_step(c: Controller, rank: int, ev: Mapping[str, Any]) -> None:
    step, attempt = ev.get("step"), c.attempt
    if isinstance(step, int) and isinstance(ev.get("data_positions"), list):
        c.books.data.record(step, ev["data_positions"], ev.get("step_time_s"), int(ev.get("dp") or 0))
    if rank == 0 and isinstance(ev.get("step_time_s"), int | float):
        times = c.books.straggler.step_times
        times.append(float(ev["step_time_s"]))
        del times[:-50]
        _measure(c, step, ev)
    # Within an attempt steps only grow; a restart resumes from its checkpoint, so the progress may
    # step back to it.
    if isinstance(step, int) and step >= attempt.step:
        _progress(c, step, ev)
    if isinstance(ev.get("memory"), Mapping):
        _on_memory(c, rank, ev["memory"])
    if isinstance(step, int):
        attempt.markers[rank] = (step, 0)
        cfg = c.run_cfg.checkpoint
        every = cfg.every_steps
        ckpt_on = bool(cfg.dir) and not cfg.async_save
        due = (every and step % every == 0) or step == c.run_cfg.steps
        if ckpt_on and attempt.ckpt_open is None and due:
            attempt.ckpt_open = step


def _measure(c: Controller, step: Any, ev: Mapping[str, Any]) -> None:
    """Rank 0's step and phase times into the job's measured performance (warm-up per attempt)."""
    if not isinstance(step, int):
        return
    attempt = c.attempt
    if attempt.first_step is None:
        attempt.first_step = step
    phases = ev.get("phases") if isinstance(ev.get("phases"), Mapping) else None
    if c.job.perf.record(step - attempt.first_step + 1, float(ev["step_time_s"]), phases):
        c.job.progress["perf"] = c.job.perf.summary()


def _on_memory(c: Controller, rank: int, account: Mapping[str, Any]) -> None:
    """A rank's memory account (its first step): progress["memory"] keeps each rank's and, per term, the
    largest (the plan's memory_per_gpu_bytes are the peak rank's); one event once every rank reported."""
    doc = c.job.progress.setdefault("memory", {"ranks": {}})
    doc["ranks"][str(rank)] = dict(account)
    measured: dict[str, int] = {}
    for r in doc["ranks"].values():
        for t in ("params", "grads", "optimizer", "activations", "peak_allocated"):
            if isinstance(r.get(t), int | float):
                measured[t] = max(measured.get(t, 0), int(r[t]))
    doc["measured"] = measured
    if len(doc["ranks"]) == c.run_cfg.layout.world_size and not doc.get("reported"):
        doc["reported"] = True
        c.log.emit(EventKind.MEMORY, "memory per rank (peak rank): " + ", ".join(
            f"{t} {v / 2**20:.1f} MiB" for t, v in doc["measured"].items()), **doc["measured"])


def _progress(c: Controller, step: int, ev: Mapping[str, Any]) -> None:
    fault_clock = c.books.clock
    if fault_clock.recovering and step > c.attempt.step:
        took = fault_clock.resumed(float(ev.get("t") or c.clocks.wall()))
        if took is not None:
            c.log.emit(EventKind.RESUMED, f"training resumed: step {step} done {took:.1f}s after the "
                       "detection", step=step, time_to_recover_s=took)
    c.attempt.step = step
    p = c.job.progress
    p["step"] = step
    for key in ("loss", "tokens_per_s", "mfu", "step_time_s"):
        if ev.get(key) is not None:
            p[key] = ev[key]


def _on_checkpoint(c: Controller, rank: int, ev: Mapping[str, Any], world: int) -> None:
    step = int(ev["step"])
    saved = c.attempt.ckpt_saved.setdefault(step, set())
    saved.add(rank)
    if len(saved) != world:
        return
    c.job.progress["last_checkpoint_step"] = step
    c.log.emit(EventKind.CHECKPOINT_SAVED, f"checkpoint of step {step} committed",
               CheckpointSaved(step, ev.get("path"), ev.get("bytes"), ev.get("seconds"),
                               step in c.scrubber.ledger.verified))
    c.scrubber.committed(step, str(ev.get("path") or ""))
    if c.attempt.ckpt_open is not None and c.attempt.ckpt_open <= step:
        c.attempt.ckpt_open = None


def _on_restored(c: Controller, step: Any, source: str = "checkpoint") -> None:
    c.attempt.restored_seen = True
    restored = int(step) if isinstance(step, int) else 0
    if source == "checkpoint" and restored:  # ranks restore only checkpoints verified or saved verified
        c.scrubber.ledger.mark_verified(restored)
    reached = c.recovery.reached
    books = c.books
    dropped = books.data.rollback(restored)
    if restored:
        _fill_data(c, restored)
    if reached is not None:
        lost = max(reached - restored, 0)
        books.clock.lost(lost)
        ledger = c.scrubber.ledger
        what = ("the DP peers' state" if source == "peers" else "the verified checkpoint")
        c.log.emit(EventKind.RESTORE, f"restored {what} of step {restored}; {lost} step(s) lost",
                   step=restored, steps_lost=lost, source=source, verified=sorted(ledger.verified),
                   corrupt=sorted(ledger.corrupt))
        c.recovery.reached = None
    elif dropped:
        books.clock.lost(dropped)
    c.job.progress["step"] = restored
    c.attempt.step = c.attempt.restored = restored


def _fill_data(c: Controller, restored: int) -> None:
    """Complete the data ledger up to the restored step from the data source's positions."""
    try:
        from training.data.sources import make_data_source

        cfg = c.run_cfg
        source = make_data_source(cfg.data, cfg.model, cfg.global_batch)
        dp = cfg.layout.dp
        c.books.data.fill(restored, dp, lambda s, r: source.positions(s, r, dp))
    except Exception as e:  # noqa: BLE001 - any failure of the data source leaves the ledger as reported
        log.warning("could not complete the data ledger: %s", e)


def final_result(c: Controller, status: GroupStatus) -> dict[str, Any]:
    """The job's result from the ranks' results and the controller's books."""
    results = {r: s.result or {} for r, s in status.ranks.items()}
    first = results.get(0, {})
    # With pp > 1 every rank reports the same global loss; take the first non-empty list.
    losses = next((res["losses"] for res in results.values() if res.get("losses")), [])
    return {
        "final_step": first.get("final_step"),
        "model_digest": first.get("model_digest"),
        "losses": losses,
        "checkpoints": first.get("checkpoints", []),
        "resumed_from": first.get("resumed_from"),
        "restarts": c.job.restarts,
        "layout": c.run_cfg.layout.to_dict(),
        "data_positions": c.books.data.summary(),
        "faults": c.fault_stats(),
    }
