"""Classification of every failure before the controller acts on it, and the crash-loop breaker.

A failure is one of three classes (`workers.policies.FailureClass`), decided from its evidence:

- *job error*: the job's own mistake, the same on any hardware: a bad spec or data (the engine's
  `DataError`, `SpecError`, `LayoutError`..., a ValueError raised by the configuration or the
  data), an exception raised identically on every rank or again on the re-run after a restart, a
  non-finite loss that the engine's re-run of the step reproduced on every replica
  (training.integrity.rerun `diverged`), an integrity failure of every rank at the same step again.
  The job fails at once with the reason and the rank's traceback; no node is blamed.
- *infrastructure*: actor or node death, hang, straggler, collective errors and timeouts, a damaged
  checkpoint, an SDC that singles out ranks (also a reproduced one whose batches gave other results
  on the DP peers' devices: training.integrity.swap): restart, and count against the node.
- *unknown*: anything else (an exception seen once): restart within the budget, blame nobody; if
  it recurs identically on the next attempt it is a job error.

`FailureHistory` remembers the previous failure's signature and the attempts in a row that
completed no new step (the crash-loop breaker fails the job after `crash_loop_attempts` of them).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from workers.controller.attempt import Attempt
from workers.policies import Failure, FailureClass, FailureKind

# Exceptions of the engine that always mean a bad spec or bad data (training.data, training.config...).
JOB_ERROR_TYPES = frozenset({"DataError", "SpecError", "LayoutError", "TokenFileError", "MoEError",
                             "ContextParallelError", "InteropError"})
# A ValueError / TypeError raised in these files is a configuration or data error.
CONFIG_ORIGINS = ("/training/config/", "/training/data/")
CONFIG_TYPES = frozenset({"ValueError", "TypeError"})
# Collective and transport failures: the fabric or a peer, not the job.
INFRA_TYPES = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
                         "TimeoutError", "ConnectionError", "BrokenPipeError", "ActorDiedError",
                         "RayActorError", "NodeDiedError"})
INFRA_MESSAGE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|timed out|timeout|socket|"
                           r"broken pipe|cuda error|uncorrectable ecc|xid", re.IGNORECASE)
# The engine's statistical gradient checks, which the data can trip too (training.integrity.rerun).
STATISTICAL_KINDS = ("grad_norm_spike", "grad_norm_outlier")
_INFRA_KINDS = frozenset({FailureKind.RANK_DIED, FailureKind.NODE_DIED, FailureKind.HANG,
                          FailureKind.STARTUP, FailureKind.CHECKPOINT, FailureKind.STRAGGLER})


@dataclass
class FailureHistory:
    """What the classifier remembers across the attempts of one controller."""

    last_signature: tuple[Any, ...] | None = None
    best_step: int = 0  # the highest step any attempt completed
    stalled: int = 0  # attempts in a row, up to the last failure, that completed no new step


def note_progress(history: FailureHistory, attempt: Attempt) -> int:
    """The crash-loop count after `attempt` failed: 0 if it completed a step no attempt had before,
    otherwise one more than the previous count."""
    progressed = attempt.step > max(history.best_step, attempt.restored)
    history.best_step = max(history.best_step, attempt.step)
    history.stalled = 0 if progressed else history.stalled + 1
    return history.stalled


def crash_loop_reason(history: FailureHistory, limit: int, failure: Failure) -> str | None:
    """The reason to fail a job that made no progress in `limit` consecutive attempts, or None."""
    if limit <= 0 or history.stalled < limit:
        return None
    return (f"crash loop: no progress in {history.stalled} consecutive attempts (no new completed step "
            f"after step {history.best_step}); last failure: {failure.kind}: {failure.message}")


def rank_report(failure: Failure, attempt: Attempt) -> dict[str, Any] | None:
    """The failed rank's own report (exception, types, origin, traceback): the lowest failed rank
    with one, preferring a rank whose error is not a collective's echo of another rank's failure."""
    every = [(r, attempt.errors[r]) for r in sorted(attempt.errors)]
    reports = [(r, rep) for r, rep in every if not failure.ranks or r in failure.ranks] or every
    if not reports:
        return None
    own = [(r, rep) for r, rep in reports if not _infra_error(rep)]
    rank, report = (own or reports)[0]
    return {**report, "rank": rank}


def classify(failure: Failure, attempt: Attempt, history: FailureHistory) -> Failure:
    """`failure` with its class and the reason for it; remembers its signature for the next one."""
    raised = failure.kind in (FailureKind.RANK_ERROR, FailureKind.SDC)
    report = rank_report(failure, attempt) if raised else None
    signature = _signature(failure, report)
    cls, why = _decide(failure, attempt, report, signature == history.last_signature)
    history.last_signature = signature
    return dataclasses.replace(failure, classification=cls, why=why)


def _decide(failure: Failure, attempt: Attempt, report: dict[str, Any] | None,
            recurred: bool) -> tuple[FailureClass, str]:
    if failure.kind in _INFRA_KINDS:
        return FailureClass.INFRASTRUCTURE, f"{failure.kind}: the node or the fabric, not the job"
    if failure.kind == FailureKind.SDC:
        return _decide_sdc(failure, attempt, recurred)
    error = (report or {}).get("error") or failure.message
    where = _where(report)
    types = set((report or {}).get("error_types") or [_type_of(error)])
    origin = str((report or {}).get("origin") or "")
    if types & JOB_ERROR_TYPES:
        return FailureClass.JOB_ERROR, f"job error: {error}{where}"
    if _infra_error(report or {"error": error}):
        return FailureClass.INFRASTRUCTURE, f"a collective or transport error{where}: {error}"
    if types & CONFIG_TYPES and any(o in origin for o in CONFIG_ORIGINS):
        return FailureClass.JOB_ERROR, f"job error: {error}{where}"
    world = len(attempt.rank_node)
    if world > 1 and len(attempt.errors) == world and len({_exc(r) for r in attempt.errors.values()}) == 1:
        return FailureClass.JOB_ERROR, f"job error, raised on every rank: {error}{where}"
    if recurred:
        return FailureClass.JOB_ERROR, f"job error, reproduced on the re-run: {error}{where}"
    return FailureClass.UNKNOWN, f"not known to be the job's or a node's (seen once): {error}{where}"


def _decide_sdc(failure: Failure, attempt: Attempt, recurred: bool) -> tuple[FailureClass, str]:
    info = failure.evidence or {}
    ev = info.get("evidence") or {}
    kind, step = info.get("error_kind"), info.get("step", failure.step)
    diverged = ev.get("diverged")
    if isinstance(diverged, dict):
        return FailureClass.JOB_ERROR, (f"diverged, reproduced: {diverged.get('what', 'loss')} is "
                                        f"{diverged.get('value', 'nan')} at step {step} on re-run")
    swapped = ev.get("swap") or {}
    if swapped.get("follows_data") is False and failure.ranks:
        # Reproduced on the named ranks' devices and not on their DP peers' (training.integrity.swap):
        # a persistent fault of those devices, whether or not the restart kept them (nobody was blamed
        # before the restart that re-ran a statistical check).
        return FailureClass.INFRASTRUCTURE, (f"{kind} at step {step} on rank(s) {list(failure.ranks)}, "
                                             "reproduced on their devices only: persistent")
    if recurred and failure.ranks and len(failure.ranks) < len(attempt.rank_node):
        # The same check at the same step again, after the restart that kept the blamed node out:
        # it followed the job, not a node (no second node is quarantined for the job's data).
        return FailureClass.JOB_ERROR, (f"{kind} at step {step} again after the restart, on other "
                                        f"hardware: the job's, not a node's")
    if kind in STATISTICAL_KINDS and "transient" not in ev:
        # A statistical check no re-run confirmed (no pre-step snapshot: ZeRO >= 1, DP >= 3): the
        # data can spike a gradient too, so the restart is the re-run and nobody is blamed yet.
        return FailureClass.UNKNOWN, (f"{kind} at step {step} on rank(s) {list(failure.ranks)}, not "
                                      "re-run: restarting from the checkpoint before blaming anyone")
    world = len(attempt.rank_node)
    if kind == "divergent_replicas" or (world and 0 < len(failure.ranks) < world):
        # Replicas of a deterministic step must be bitwise equal: a mismatch is the hardware's.
        return FailureClass.INFRASTRUCTURE, f"{kind} at step {step} singled out rank(s) {list(failure.ranks)}"
    if recurred:
        return FailureClass.JOB_ERROR, (f"diverged, reproduced: {kind} at step {step} on re-run "
                                        "(again after the restart, on every rank)")
    return FailureClass.UNKNOWN, (f"{kind} at step {step} on every rank: re-running it before blaming "
                                  "anyone")


def spike_to_rerun(failure: Failure) -> tuple[int, dict[int, float]] | None:
    """A local gradient-norm spike that no re-run from a pre-step snapshot tested: its step and
    each named rank's norm, for the restart to re-run (training.hooks.TrainHooks.rerun_spikes)."""
    info = failure.evidence or {}
    ev = info.get("evidence") or {}
    norms = ev.get("grad_norms_local")
    if (failure.kind != FailureKind.SDC or info.get("error_kind") not in STATISTICAL_KINDS
            or "transient" in ev or not isinstance(norms, dict)):
        return None
    return int(info.get("step", failure.step)), {int(r): float(v) for r, v in norms.items()}


def _signature(failure: Failure, report: dict[str, Any] | None) -> tuple[Any, ...]:
    """What must be equal for a failure to count as the same one again."""
    if failure.kind == FailureKind.SDC:
        info = failure.evidence or {}
        return ("sdc", info.get("error_kind"), info.get("step", failure.step))
    if failure.kind == FailureKind.RANK_ERROR:
        return ("rank_error", _exc(report) if report else failure.message)
    return (str(failure.kind), failure.ranks, failure.step)


def _exc(report: dict[str, Any]) -> str:
    return str(report.get("error") or "")


def _type_of(error: str) -> str:
    return error.split(":", 1)[0].strip()


def _infra_error(report: dict[str, Any]) -> bool:
    types = set(report.get("error_types") or [_type_of(_exc(report))])
    return bool(types & INFRA_TYPES) or bool(INFRA_MESSAGE.search(_exc(report)))


def _where(report: dict[str, Any] | None) -> str:
    if not report:
        return ""
    step = report.get("step")
    return f" (rank {report.get('rank')}" + (f", after step {step})" if isinstance(step, int) else ")")
