"""The knobs of one job controller (timeouts, fault injection, fault handling), set by the service."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.logs import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES
from workers.rank import DEFAULT_TRAIN_FN


@dataclass(frozen=True)
class ControllerOptions:
    poll_interval_s: float = 0.5
    hang_timeout_s: float = 60.0  # no progress from a rank after its first step (seconds)...
    hang_step_factor: float = 5.0  # ...or this many typical (median recent) step times, if longer
    startup_timeout_s: float = 300.0  # before a rank's first step: imports, model build, rendezvous
    checkpoint_timeout_s: float = 600.0  # no-progress limit while a checkpoint is being saved
    reserve_timeout_s: float = 30.0
    start_timeout_s: float = 120.0
    rank_poll_timeout_s: float = 10.0
    cpus_per_rank: float = 0.1
    train_fn: str = DEFAULT_TRAIN_FN
    flops_per_token: float | None = None
    resume: bool = True  # the first attempt also resumes from an existing checkpoint
    first_seq: int = 0  # a replacement controller continues its predecessor's event numbering
    max_events: int = 10_000
    linger_s: float | None = 3600.0  # a terminal controller actor exits after this (None: never)
    # Faults to inject (specs in workers.faults); each fires once over the job's life, re-armed
    # after a restart until it has fired.
    faults: tuple[Mapping[str, Any], ...] = ()
    env_vars: Mapping[str, str] = field(default_factory=dict)
    log_max_bytes: int = DEFAULT_MAX_BYTES  # each rank's log file per attempt (workers.logs)...
    log_backups: int = DEFAULT_BACKUPS  # ...and the rotated files kept beside it
    fast_path: bool = True  # replace only dead/hung ranks, keeping the others' processes
    peer_recovery: bool = True  # ...from their DP peers' memory when they can (workers.recovery_path)
    quarantine_after: int = 3  # faults on one node before it is quarantined...
    quarantine_jobs: int = 2  # ...from this many different jobs (this controller sees one: never)
    crash_loop_attempts: int = 3  # fail a job with no new completed step in this many attempts in a row
    straggler_lag_s: float = 1.0  # last arrival at the step's collective this much behind the first...
    straggler_factor: float = 2.0  # ...and this many median step times...
    straggler_steps: int = 3  # ...this many steps in a row: a straggler
    straggler_action: str = "restart"  # "restart" (off its node) or "report"
    failure_grace_s: float = 5.0  # ranks failed while others are unresponsive: wait this long to blame
    referee: bool = True  # DP = 2 replicas disagreeing persistently: replay the step on a spare
    spares: int = 0  # warm spare rank actors kept while the job runs (workers.spares)
    warm_workers: int = 1  # idle processes, engine imported, per node of the job (workers.warm_workers)
    warm_standby: bool = True  # ...and on its standby nodes, one per rank that would move there

    @property
    def collective_timeout_s(self) -> float:
        """The ranks' process-group timeout (NCCL's watchdog): finite, and past every no-progress limit
        above (hang, start-up, checkpoint), so that the controller finds and attributes a hang (and has
        the ranks dump their flight recorders) before a watchdog aborts the ranks still waiting."""
        return max(self.hang_timeout_s, self.startup_timeout_s, self.checkpoint_timeout_s) + 60.0
