"""Failure detection from one poll of the ranks: pure functions that return a typed `Failure`.

- `death`: ranks whose actor is gone, and whether their node went with them;
- `hang`: ranks without progress, the culprit found by who never entered the step's collective;
- `straggler`: a rank the `StragglerWatch` found arriving last, step after step;
- `sdc`: the engine's integrity error (NaN/Inf, loss spike, divergent DP replicas);
- `detect`: all of them in order, over a `GroupStatus` and the current `Attempt`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from workers.controller.attempt import Attempt
from workers.controller.options import ControllerOptions
from workers.policies import Failure, FailureKind
from workers.worker_group import GroupStatus

# A rank's error that says its peer in a collective went away (gloo, NCCL, the TCP store).
PEER_LOST = re.compile(r"connection (closed|reset) by peer|broken pipe|connection reset|"
                       r"remote (process|worker|peer) (exited|crash)", re.IGNORECASE)

# How each kind of failure is noticed, as the failure event reports it.
DETECTED_BY: dict[FailureKind, str] = {
    FailureKind.RANK_DIED: "actor death (ActorDiedError)",
    FailureKind.NODE_DIED: "node death (the node left the cluster; its actors died)",
    FailureKind.HANG: "heartbeat timeout",
    FailureKind.STRAGGLER: "collective arrival times",
    FailureKind.SDC: "integrity checks (fingerprint vote / re-run, local gradient norm, NaN/Inf, loss spike)",
    FailureKind.RANK_ERROR: "rank error",
    FailureKind.STARTUP: "startup",
    FailureKind.CHECKPOINT: "manifest verification",
}


def progress_timeout(options: ControllerOptions, stepped: bool, saving: bool, step_s: float = 0.0) -> float:
    """How long a running rank may go without progress before it counts as hung. A rank reports
    progress about once a step, so a job whose steps take longer than the heartbeat timeout (a big
    model, a loaded host) gets `hang_step_factor` typical steps (`step_s`, the median of the recent
    ones), short of the ranks' collective timeout, which must not fire first."""
    if not stepped:
        return options.startup_timeout_s
    limit = max(options.hang_timeout_s,
                min(options.hang_step_factor * step_s, options.collective_timeout_s - 60.0))
    # A save runs between two steps and may outlast the heartbeat timeout.
    if saving:
        return max(limit, options.checkpoint_timeout_s)
    return limit


def death(
    ranks: list[int], status: GroupStatus, attempt: Attempt, node_gone: Callable[[str], bool], step: Any
) -> Failure:
    """`ranks` died: a node death if their node left the cluster, else a rank death. A node that
    left takes every rank it held, including those whose death no poll has shown yet."""
    nodes = attempt.nodes(ranks)
    gone = [n for n in nodes if node_gone(n)]
    errors = {r: status.ranks[r].error for r in ranks}
    if gone:
        on_gone = tuple(sorted(r for r, n in attempt.rank_node.items() if n in gone))
        return Failure(FailureKind.NODE_DIED, f"node(s) {gone} died with rank(s) {list(on_gone)}",
                       on_gone, tuple(gone), step, evidence={"errors": errors})
    return Failure(FailureKind.RANK_DIED, f"rank(s) {ranks} died: {status.ranks[ranks[0]].error}",
                   tuple(ranks), nodes, step, evidence={"errors": errors})


def hang(stale: list[int], status: GroupStatus, attempt: Attempt, timeout_s: float, step: Any) -> Failure:
    """`stale` ranks made no progress. Everyone waits in the collective the hung rank never joined:
    the culprits are the ranks whose last report is furthest behind ((step, entered the
    collective)), else the ones that stopped earliest (lowest step, then longest silence).

    The reports of every running rank are compared, not only the stale ones': the hung rank's last
    report (its step) may come a few milliseconds after its peers' (entering the collective that
    follows), so the peers go stale first, and among them alone the furthest behind is a waiter."""
    running = sorted(r for r, s in status.ranks.items() if s.state == "running")  # includes `stale`
    markers = {r: attempt.markers.get(r) for r in running}
    evidence: dict[str, Any] = {"stale_ranks": stale,
                                "last_report": {str(r): m for r, m in markers.items()}}
    known = {r: m for r, m in markers.items() if m is not None}
    if len(known) == len(markers) and len(set(known.values())) > 1:
        low = min(known.values())
        culprits = sorted(r for r, m in known.items() if m == low)
        waiting = sorted(r for r, m in known.items() if m != low)
        evidence["waiting_in_collective"] = waiting
        longest = max(status.ranks[r].since_progress_s for r in culprits)
        return Failure(FailureKind.HANG, f"rank(s) {culprits} never entered the step-{low[0]} collective "
                       f"that rank(s) {waiting} wait in ({longest:.0f}s)", tuple(culprits),
                       attempt.nodes(culprits), step, evidence=evidence)
    low_step = min((status.ranks[r].step or 0) for r in stale)
    behind = [r for r in stale if (status.ranks[r].step or 0) == low_step]
    longest = max(status.ranks[r].since_progress_s for r in behind)
    culprits = sorted(r for r in behind if status.ranks[r].since_progress_s >= longest - 1.0)
    return Failure(FailureKind.HANG, f"no progress from rank(s) {culprits} for {longest:.0f}s "
                   f"(timeout {timeout_s:.0f}s)", tuple(culprits), attempt.nodes(culprits), step,
                   evidence=evidence)


def straggler(found: Mapping[str, Any], attempt: Attempt, step: Any) -> Failure:
    """`found` is what `StragglerWatch.arrive` returned: the rank and its recent lags."""
    rank = int(found["rank"])
    return Failure(FailureKind.STRAGGLER, f"rank {rank} reached the step's collective last by "
                   f"{found['lags'][-1]['lag_s']:.1f}s for {len(found['lags'])} steps in a row",
                   (rank,), attempt.nodes([rank]), step, evidence=dict(found))


def sdc(info: Mapping[str, Any], failed: Collection[int], attempt: Attempt) -> Failure:
    """The engine's checks (NaN/Inf, loss spike, divergent DP replicas) name the ranks."""
    culprits = tuple(info.get("ranks") or failed)
    return Failure(FailureKind.SDC, f"integrity check {info.get('error_kind')} failed at step "
                   f"{info.get('step')} on rank(s) {list(culprits)}", culprits, attempt.nodes(culprits),
                   info.get("step"), evidence=dict(info))


def detect(
    status: GroupStatus,
    now: float,
    attempt: Attempt,
    options: ControllerOptions,
    step: Any,
    node_gone: Callable[[str], bool],
    found_straggler: Mapping[str, Any] | None,
    step_s: float = 0.0,
) -> Failure | None:
    """The failure this poll shows, if any, the most certain first. Starts the attempt's grace
    period (`attempt.failed_since`) when ranks failed while others are unresponsive. `step_s`: the
    job's typical step time (progress_timeout)."""
    dead = status.in_state("dead")
    if dead:
        return death(dead, status, attempt, node_gone, step)
    failed = status.in_state("failed")
    if failed and attempt.integrity is not None:
        return sdc(attempt.integrity, failed, attempt)
    unresponsive = status.in_state("unresponsive")
    if failed and unresponsive:
        # Peers of a rank that is gone fail in their collectives first: blame the silent one.
        attempt.failed_since = attempt.failed_since or now
        if now - attempt.failed_since < options.failure_grace_s:
            return None
        return death(unresponsive, status, attempt, node_gone, step)
    if failed:
        # The ranks with an error of their own, not the peers whose collective with them broke.
        own = [r for r in failed if not PEER_LOST.search(status.ranks[r].error or "")]
        if not own:
            # A collective broken by a peer that went away fails the survivors first; the peer's death
            # shows a poll or a health check later (a node's takes seconds). Blame them only after that.
            attempt.failed_since = attempt.failed_since or now
            if now - attempt.failed_since < options.failure_grace_s:
                return None
            own = failed
        first = status.ranks[own[0]]
        return Failure(FailureKind.RANK_ERROR, f"rank(s) {own} failed: {first.error}",
                       tuple(own), attempt.nodes(own), step)
    gone = [r for r in unresponsive if (n := attempt.rank_node.get(r)) and node_gone(n)]
    if gone:
        return death(gone, status, attempt, node_gone, step)
    # A rank that has not stepped in this attempt is starting (a fresh actor importing torch may not
    # answer a poll for a while on a loaded node): the start-up timeout applies to it, as to its progress.
    silent = [r for r in unresponsive if now - attempt.last_seen.get(r, now)
              > progress_timeout(options, r in attempt.stepped, False, step_s)]
    if silent:
        limit = progress_timeout(options, all(r in attempt.stepped for r in silent), False, step_s)
        return Failure(FailureKind.HANG, f"rank(s) {silent} unresponsive for over {limit:.0f}s",
                       tuple(silent), attempt.nodes(silent), step)
    saving = attempt.ckpt_open is not None
    stale = [r for r, s in status.ranks.items() if s.state == "running"
             and s.since_progress_s > progress_timeout(options, s.stepped, saving, step_s)]
    if stale:
        return hang(stale, status, attempt, progress_timeout(options, True, saving, step_s), step)
    if found_straggler is not None:
        return straggler(found_straggler, attempt, step)
    return None
