"""RECOVERING: how a failed attempt comes back (the controller's state machine calls `recover`).

The fast path replaces only the lost ranks; the others keep their processes, except on a quarantined
node, which keeps nothing of the job: ranks that survived there are replaced with the lost ones.
Ranks replaced on a node that must not be used again move (workers.relocate, TP groups whole). When
every lost rank has a healthy DP peer and the failure lost ranks without corrupting anything, the
replacements take their peers' in-memory state and nothing rolls back (the peer path,
workers.recovery_path); otherwise everyone restores the last verified checkpoint. When the fast path
cannot run, every rank is re-placed.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from workers.controller.state import ControllerState, Transition
from workers.events import EventKind, Restart
from workers.placement import PlacementError
from workers.policies import FailureKind
from workers.worker_group import WorkerGroupError

if TYPE_CHECKING:
    from workers.controller.machine import ControllerStateMachine

# Failures that lose ranks but leave the survivors' memory trustworthy (the peer path may apply);
# after corruption (SDC) the peers' state is suspect too.
PEER_RECOVERABLE = frozenset({FailureKind.RANK_DIED, FailureKind.NODE_DIED, FailureKind.HANG,
                              FailureKind.STRAGGLER})


def recover(sm: ControllerStateMachine) -> Transition:
    job, recovery = sm.job, sm.recovery
    sm.injector.expire(job.progress["step"] or 0)
    job.restarts += 1
    recovery.resume = True
    cause = str(recovery.failure.kind) if recovery.failure else "unknown"
    sm.scrubber.scrub_on_disk(sm.run_cfg.checkpoint.dir)
    expected = sm.scrubber.expected_restore()
    common = {"restarts": job.restarts, "cause": cause, "restore_step": expected,
              "restore_steps": sorted(sm.restore_steps() or []),
              "exclude_nodes": sorted(sm.attributor.exclude)}
    ranks, recovery.fast_ranks = recovery.fast_ranks, []
    failure = recovery.failure
    # A quarantined node keeps nothing of the job: ranks that survived there move with the lost ones
    # (their state comes back as the lost ranks' does, from DP peers elsewhere or the checkpoint).
    evicted = evicted_ranks(job.placement, sm.attributor.quarantined_nodes, ranks) if ranks else []
    if evicted:
        ranks = sorted({*ranks, *evicted})
        common = {**common, "evicted": evicted}
    # A node death that took every rank: nothing to keep, place the job anew (as one gang).
    everything = (len(set(ranks)) == sm.run_cfg.layout.world_size and failure is not None
                  and failure.kind == FailureKind.NODE_DIED)
    why = ("the node death took every rank" if everything else
           f"the fast path does not apply to a {cause} failure" if not ranks else "")
    if ranks and not everything:
        allow_peer = (sm.options.peer_recovery and failure is not None and failure.kind in PEER_RECOVERABLE
                      and not recovery.peer_failed)
        recovery.peer_failed = False
        bad = sm.attributor.bad_nodes() | set(sm.injector.dead_nodes)
        if failure is not None and failure.kind == FailureKind.NODE_DIED:
            bad |= set(failure.nodes)
        try:
            actual = sm.wg.replace_ranks(ranks, sm.run_cfg, faults=list(sm.injector.pending),
                                         restore_steps=sm.restore_steps(), allow_peer=allow_peer,
                                         rerun_spikes=recovery.spikes_to_rerun(sm.run_cfg.layout),
                                         avoid_nodes=bad, prefer_avoid=sm.attributor.exclude - bad)
        except (WorkerGroupError, PlacementError) as e:
            why = f"replacing ranks {ranks} failed: {e}"
            sm.log.emit(EventKind.FAST_PATH_FAILED, f"replacing ranks {ranks} failed, restarting all: {e}")
        else:
            return _replaced(sm, ranks, actual, cause, expected, common)
    sm.wg.shutdown()
    recovery.peer_step, recovery.peer_failed = None, False
    sm.books.clock.restarted(cause, "full")
    sm.log.emit(EventKind.RESTART, f"restart {job.restarts}: re-placing every rank, resuming from step "
                f"{expected} ({why})", Restart(path="full", recovery={"path": "checkpoint", "why": why},
                                               **common))
    return sm._to(ControllerState.PLACING, "re-placing after a failure")  # noqa: SLF001 - the machine's helper


def evicted_ranks(placement: Collection[dict[str, Any]], quarantined: Collection[str],
                  lost: Collection[int]) -> list[int]:
    """The ranks other than `lost` that run on a quarantined node (they leave it at the restart)."""
    bad, gone = set(quarantined), set(lost)
    return sorted(r["rank"] for r in placement if r.get("node_name") in bad and r["rank"] not in gone)


def _replaced(sm: ControllerStateMachine, ranks: list[int], actual: Collection[Any], cause: str,
              expected: int | None, common: dict[str, Any]) -> Transition:
    """The fast path went through: from the DP peers' memory (no step lost) or the checkpoint."""
    job, path = sm.job, sm.wg.last_recovery
    peer = path is not None and path.path == "peer"
    sm.books.clock.restarted(cause, "peer" if peer else "fast")
    job.placement = [r.to_dict() for r in actual]
    sm._begin_attempt(actual)  # noqa: SLF001 - the machine's helper
    sm.recovery.peer_step = path.step if peer and path is not None else None
    replaced = sorted(set(ranks) | set(path.lost if path is not None else ()))
    if peer and path is not None:
        common = {**common, "restore_step": path.step}
        message = (f"restart {job.restarts} (peer path): replaced ranks {replaced} with their DP peers' "
                   f"state of step {path.step}, the others kept theirs; nothing rolled back")
    else:
        why = f" (not from peers: {path.why})" if path is not None else ""
        message = (f"restart {job.restarts} (fast path): replaced ranks {replaced}, the others kept their "
                   f"processes; resuming from step {expected}{why}")
    if common.get("evicted"):
        message += f"; ranks {common['evicted']} moved off the quarantined node(s) with them"
    restart = Restart(path="peer" if peer else "fast", replaced=replaced, placement=job.placement,
                      recovery=path.to_dict() if path is not None else None, **common,
                      **sm.wg.replacement_info())
    sm.log.emit(EventKind.RESTART, message, restart)
    return sm._to(ControllerState.RUNNING, "ranks replaced")  # noqa: SLF001 - the machine's helper
