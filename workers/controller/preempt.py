"""Preemption that loses nothing: a notice makes the ranks checkpoint at the next step boundary and
stop, and the controller ends in PREEMPTED (the service puts the job back in the queue, and its next
controller resumes from that checkpoint).

`request` records the notice (any thread); the state machine calls `on_poll` from RUNNING /
CHECKPOINTING after reading the ranks' events, and `stop_now` from any other non-terminal state
(nothing is training there: the job stops at once). Past the notice's grace period the controller
stops the ranks anyway; the job then resumes from its last verified checkpoint and the steps after
it are counted as lost (`steps_lost` in the `preempted` event).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.controller.state import ControllerState, Transition
from workers.events import EventKind
from workers.worker_group import GroupStatus

if TYPE_CHECKING:
    from workers.controller.machine import ControllerStateMachine

DEFAULT_GRACE_S = 120.0
MAX_GRACE_S = 3600.0


@dataclass
class PreemptNotice:
    reason: str
    grace_s: float
    deadline: float  # on the controller's monotonic clock
    sent: bool = False  # the ranks were asked to checkpoint and stop


def request(sm: ControllerStateMachine, reason: str, grace_s: float = DEFAULT_GRACE_S) -> bool:
    """Record a preemption notice; False if the job is already ending or has one."""
    if sm.state.terminal or sm.preemption is not None or sm.cancel_requested:
        return False
    grace = min(max(float(grace_s), 0.0), MAX_GRACE_S)
    sm.preemption = PreemptNotice(reason, grace, sm.clocks.monotonic() + grace)
    step = sm.job.progress.get("step") or 0
    sm.log.emit(EventKind.PREEMPTION_REQUESTED, f"preemption requested at step {step}: {reason}",
                reason=reason, grace_s=grace, step=step)
    return True


def on_poll(sm: ControllerStateMachine, status: GroupStatus, now: float) -> Transition | None:
    """While training: ask for checkpoint-and-stop once; when every rank stopped short of the last
    step, the job is preempted at the step of that checkpoint; past the grace period, stop anyway."""
    notice = sm.preemption
    assert notice is not None
    if not notice.sent:
        sm.wg.request_action("checkpoint_and_stop")
        notice.sent = True
    if status.all_finished:
        final = _final_step(status)
        if final is None or final >= sm.run_cfg.steps:
            return None  # it finished before the notice took effect: the normal finish
        return _preempted(sm, final, graceful=True)
    if now >= notice.deadline:
        return _preempted(sm, sm.attempt.step or (sm.job.progress.get("step") or 0), graceful=False)
    return None


def stop_now(sm: ControllerStateMachine) -> Transition:
    """Not training (placing, waiting, starting, recovering): stop at once; the next start restores
    the last verified checkpoint, which a failure (if any) would have restored anyway."""
    return _preempted(sm, None, graceful=True)


def _final_step(status: GroupStatus) -> int | None:
    steps = [r.result.get("final_step") for r in status.ranks.values() if isinstance(r.result, dict)]
    steps = [s for s in steps if isinstance(s, int)]
    return min(steps) if steps else None


def _preempted(sm: ControllerStateMachine, reached: int | None, *, graceful: bool) -> Transition:
    """Stop the ranks and end PREEMPTED; the job resumes from the newest checkpoint that verifies
    (those on disk included: a controller that took over from another saw none of their commits)."""
    notice = sm.preemption
    assert notice is not None
    sm.wg.shutdown()
    sm.scrubber.scrub_on_disk(sm.run_cfg.checkpoint.dir)
    restore = sm.scrubber.expected_restore()
    reached = restore if reached is None else reached
    lost = max(0, reached - restore)
    how = "after a checkpoint at the step boundary" if graceful else \
        f"past the {notice.grace_s:.0f}s grace period"
    message = f"preempted at step {restore} ({how}; {lost} steps lost): {notice.reason}"
    sm.job.reason = message
    sm.job.progress["preempted_at"] = restore
    sm.log.emit(EventKind.PREEMPTED, message, reason=notice.reason, step=reached, restore_step=restore,
                steps_lost=lost, graceful=graceful)
    return sm._to(ControllerState.PREEMPTED, message)  # noqa: SLF001 - the machine's own helper module
