"""The job controller's state machine: pure logic, driven one `step()` at a time.

    INIT -> PLACING -> STARTING -> RUNNING <-> CHECKPOINTING -> FINISHED
               |  ^                  |
               v  |                  v (failure: policy says retry)
             WAITING              RECOVERING -> PLACING ...
    any non-terminal state -> CANCELLED (cancel) | ERRORED (policy gives up, internal error)

`ControllerStateMachine.step()` does one iteration and returns the `Transition` it made (or
None). It talks to the ranks only through a `WorkerGroup`, and to the world only through the
policies and an injected clock, so tests drive it one transition at a time against a dummy
group. Everything the service needs is in `snapshot(since_seq)`: the state, the ordered event
log after `since_seq`, progress (step, loss, tokens/s, MFU), the placement read back from the
rank actors, the result (with `model_digest`) and the reason of a terminal or waiting state.

Issue 6 (fault tolerance) lives here too: faults are injected (rank faults armed on the ranks,
kill_node and corrupt_checkpoint carried out by the controller), detected (dead ranks and nodes,
hangs by heartbeat with the culprit found by who never entered the step's collective, stragglers,
SDC from the engine's checks, damaged checkpoints by manifest scrubbing), attributed (rank, node,
evidence), recorded in the node ledger (suspect, quarantined, dead), and recovered from: the fast
path replaces only the dead ranks, otherwise everything is re-placed on healthy nodes; either way
the ranks restore the last *verified* checkpoint. The event log tells the story in order:
fault_injected, failure (detection), attributed, node_suspect / node_quarantined / node_dead,
restart, restore, resumed (workers.fault_ledger keeps the books).

`workers.controller.JobController` is the detached Ray actor that runs this loop.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from training.config.run import RunConfig
from workers.fault_ledger import CheckpointLedger, DataLedger, FaultClock, NodeLedger, StragglerWatch
from workers.faults import normalize_faults
from workers.placement import PlacementError, place
from workers.policies import (
    Failure,
    FailureKind,
    FailurePolicy,
    HoldLayoutPolicy,
    RestartPolicy,
    ScalingAction,
    ScalingPolicy,
)
from workers.rank import DEFAULT_TRAIN_FN
from workers.recovery import FaultHandling
from workers.worker_group import GroupStatus, WorkerGroup, WorkerGroupError

log = logging.getLogger(__name__)


class ControllerState(enum.StrEnum):
    INIT = "INIT"
    PLACING = "PLACING"
    WAITING = "WAITING"  # the layout does not fit now; placement is retried
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    CHECKPOINTING = "CHECKPOINTING"
    RECOVERING = "RECOVERING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (ControllerState.FINISHED, ControllerState.ERRORED, ControllerState.CANCELLED)


# The service's job states (ARCHITECTURE.md) for each controller state.
JOB_STATE: dict[ControllerState, str] = {
    ControllerState.INIT: "starting",
    ControllerState.PLACING: "starting",
    ControllerState.WAITING: "queued",
    ControllerState.STARTING: "starting",
    ControllerState.RUNNING: "running",
    ControllerState.CHECKPOINTING: "running",
    ControllerState.RECOVERING: "recovering",
    ControllerState.FINISHED: "succeeded",
    ControllerState.ERRORED: "failed",
    ControllerState.CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class Transition:
    from_state: ControllerState
    to_state: ControllerState
    reason: str


@dataclass(frozen=True)
class ControllerOptions:
    poll_interval_s: float = 0.5
    hang_timeout_s: float = 60.0  # no progress from a rank after its first step (issue 6: seconds)
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
    # Faults to inject (issue 6, specs in workers.faults); each fires once over the job's life,
    # re-armed after a restart until it has fired.
    faults: tuple[Mapping[str, Any], ...] = ()
    env_vars: Mapping[str, str] = field(default_factory=dict)
    fast_path: bool = True  # replace only dead/hung ranks, keeping the others' processes
    quarantine_after: int = 3  # faults on one node before it is quarantined
    straggler_lag_s: float = 1.0  # last arrival at the step's collective this much behind the first...
    straggler_factor: float = 2.0  # ...and this many median step times...
    straggler_steps: int = 3  # ...this many steps in a row: a straggler
    straggler_action: str = "restart"  # "restart" (off its node) or "report"
    failure_grace_s: float = 5.0  # ranks failed while others are unresponsive: wait this long to blame
    referee: bool = True  # DP = 2 replicas disagreeing persistently: replay the step on a spare


class ControllerStateMachine(FaultHandling):
    def __init__(
        self,
        job_id: str,
        run_cfg: RunConfig,
        worker_group: WorkerGroup,
        *,
        options: ControllerOptions | None = None,
        failure_policy: FailurePolicy | None = None,
        scaling_policy: ScalingPolicy | None = None,
        health: Mapping[str, str] | None = None,
        cordoned: Collection[str] = (),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        node_killer: Callable[[str], None] | None = None,
        checkpoint_ops: Any = None,
        referee: Callable[[RunConfig, Mapping[str, Any], Collection[str]], dict[str, Any]] | None = None,
    ) -> None:
        """`node_killer(name)` removes a node (kill_node faults); `checkpoint_ops` has
        `verify(path)` (raises on a damaged checkpoint) and `corrupt(path, which, mode)`;
        `referee(run_cfg, request, exclude_nodes)` replays a step on a spare (workers.referee)."""
        self.job_id = job_id
        self.run_cfg = run_cfg
        self.wg = worker_group
        self.options = options or ControllerOptions()
        self.failure_policy = failure_policy or RestartPolicy()
        self.scaling_policy = scaling_policy or HoldLayoutPolicy()
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.RLock()
        self.state = ControllerState.INIT
        self.events: list[dict[str, Any]] = []
        self._seq = self.options.first_seq
        self.progress: dict[str, Any] = {
            "step": 0, "total_steps": run_cfg.steps, "loss": None, "tokens_per_s": None,
            "mfu": None, "step_time_s": None, "last_checkpoint_step": None,
        }
        self.placement: list[dict[str, Any]] = []
        self.result: dict[str, Any] | None = None
        self.reason: str | None = None
        self.restarts = 0
        self._cancel_reason: str | None = None
        self._health: dict[str, str] = dict(health or {})
        self._cordoned: set[str] = set(cordoned)
        self.nodes = NodeLedger(quarantine_after=self.options.quarantine_after)
        self.ckpts = CheckpointLedger(run_cfg.checkpoint.dir)
        self.ckpts.load()
        self.data = DataLedger()
        self.clock = FaultClock()
        self.straggler = StragglerWatch(self.options.straggler_lag_s, self.options.straggler_factor,
                                        self.options.straggler_steps)
        self._node_killer = node_killer
        self._ckpt_ops = checkpoint_ops
        self._referee = referee
        self._inbox: list[tuple[int, dict[str, Any]]] = []
        self._markers: dict[int, tuple[int, int]] = {}  # rank -> (step, 0 stepped | 1 in the collective)
        self._failed_since: float | None = None
        self._failure: Failure | None = None
        self._fast_ranks: list[int] = []
        self._restored_seen = False
        self._started_wall = wall_clock()
        self._straggler: dict[str, Any] | None = None
        self._fired: set[tuple[Any, int, Any, Any]] = set()
        self._reached: int | None = None
        self._dead_nodes: set[str] = set()
        self._scrubbed: set[int] = set()
        self._corrupted_at: dict[int, float] = {}  # step -> when a corrupt_checkpoint fault damaged it
        self._exclude: set[str] = set()
        self._resume = self.options.resume
        self._placing_since: float | None = None
        self._place_attempts = 0
        self._retry_at = 0.0
        self._last_wait_reason: str | None = None
        self._rank_node: dict[int, str] = {}
        self._last_seen: dict[int, float] = {}
        self._ckpt_saved: dict[int, set[int]] = {}  # step -> ranks that reported it committed
        self._ckpt_open: int | None = None  # step whose save is under way
        self._attempt_step = 0
        self._integrity: dict[str, Any] | None = None  # the engine's integrity error in this attempt
        faults = normalize_faults(list(self.options.faults))
        # Every fault is armed on a rank; kill_node and corrupt_checkpoint are triggered by one at
        # the exact step (`trigger`) and carried out here.
        self._pending_faults = list(faults)

    # ---- the loop body ---------------------------------------------------------------------------
    def step(self) -> Transition | None:
        if self.state.terminal:
            return None
        if self._cancel_reason is not None:
            try:
                self.wg.shutdown()
            except Exception:  # noqa: BLE001 - cancelled either way; the actors die with the controller
                log.exception("job %s: worker group shutdown failed on cancel", self.job_id)
            self.reason = self._cancel_reason
            self._event("cancelled", self._cancel_reason)
            return self._to(ControllerState.CANCELLED, self._cancel_reason)
        try:
            return self._handlers[self.state](self)
        except Exception as e:  # noqa: BLE001 - a controller bug must end the job, not hang it
            log.exception("job %s: controller error in %s", self.job_id, self.state)
            return self.fail(f"controller error in {self.state}: {type(e).__name__}: {e}",
                             traceback.format_exc()[-4000:])

    def fail(self, reason: str, detail: str | None = None) -> Transition | None:
        if self.state.terminal:
            return None
        try:
            self.wg.shutdown()
        except Exception as e:  # noqa: BLE001 - the job fails either way; say why teardown failed too
            log.exception("job %s: worker group shutdown failed", self.job_id)
            detail = f"{detail or ''}\nshutdown failed: {type(e).__name__}: {e}".strip()
        self.reason = reason
        self._event("error", reason, **({"detail": detail} if detail else {}))
        return self._to(ControllerState.ERRORED, reason)

    def request_cancel(self, reason: str = "cancelled by user") -> None:
        if not self.state.terminal and self._cancel_reason is None:
            self._cancel_reason = reason

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_reason is not None

    def update_nodes(self, health: Mapping[str, str], cordoned: Collection[str]) -> None:
        """The service's health ledger and cordon set changed; used from the next placement on."""
        with self._lock:
            self._health = dict(health)
            self._cordoned = set(cordoned)

    # ---- states ------------------------------------------------------------------------------------
    def _on_init(self) -> Transition:
        self._event("controller_started", f"controller for job {self.job_id} started",
                    layout=self.run_cfg.layout.to_dict())
        return self._to(ControllerState.PLACING, "placing the ranks")

    def _health_view(self) -> dict[str, str]:
        view = dict(self._health)
        for n, h in self.nodes.health.items():
            if h == "suspect" and view.get(n, "ready") != "ready":
                continue
            view[n] = h
        return view

    def _on_placing(self) -> Transition:
        if self._placing_since is None:
            self._placing_since = self._clock()
        layout = self.run_cfg.layout
        topology = self.wg.topology(self._health_view(), self._cordoned)
        try:
            try:
                placement = place(layout, topology, exclude_nodes=self._exclude)
            except PlacementError:
                if not self._exclude:
                    raise
                # Avoiding the failed nodes is a preference; use them rather than not run.
                placement = place(layout, topology)
            self.wg.reserve(placement)
        except PlacementError as e:
            return self._unplaceable(str(e), topology)
        self._placing_since = None
        self._place_attempts = 0
        self._last_wait_reason = None
        self.placement = placement.to_list()
        self._event("placed", f"{placement.world_size} ranks reserved on "
                    f"{len(placement.by_node())} nodes ({layout.describe()})",
                    placement=self.placement, notes=list(placement.notes))
        return self._to(ControllerState.STARTING, "placement group ready")

    def _unplaceable(self, reason: str, topology: Any) -> Transition:
        self._place_attempts += 1
        waited = self._clock() - (self._placing_since or self._clock())
        decision = self.scaling_policy.on_unplaceable(
            reason, self.run_cfg.layout, topology, self._place_attempts, waited
        )
        if decision.action == ScalingAction.REPLAN and decision.layout is not None:
            old = self.run_cfg.layout
            self.run_cfg = dataclasses.replace(self.run_cfg, layout=decision.layout)
            new = decision.layout.to_dict()
            diff = {k: [v, new[k]] for k, v in old.to_dict().items() if new.get(k) != v}
            self._event("replanned", decision.reason, old=old.describe(), new=decision.layout.describe(),
                        old_layout=old.to_dict(), new_layout=new, diff=diff,
                        global_batch_kept=old.global_batch == decision.layout.global_batch)
            return self._to(ControllerState.PLACING, "placing the re-planned layout")
        if decision.action == ScalingAction.FAIL:
            return self.fail(decision.reason)
        self._retry_at = self._clock() + decision.retry_after_s
        self.reason = reason
        quiet = reason == self._last_wait_reason
        if not quiet:
            self._event("placement_failed", reason, attempts=self._place_attempts)
        self._last_wait_reason = reason
        return self._to(ControllerState.WAITING, reason, quiet=quiet)

    def _on_waiting(self) -> Transition | None:
        if self._clock() < self._retry_at:
            return None
        return self._to(ControllerState.PLACING, "retrying placement", quiet=True)

    def _restore_steps(self) -> set[int] | None:
        return self.ckpts.restore_steps() if self._resume else None

    def _on_starting(self) -> Transition:
        try:
            actual = self.wg.start(self.run_cfg, resume=self._resume, faults=list(self._pending_faults),
                                   restore_steps=self._restore_steps())
        except (WorkerGroupError, PlacementError) as e:
            return self._on_failure(Failure(FailureKind.STARTUP, str(e)))
        intended = {r["rank"]: r for r in self.placement}
        self.placement = [r.to_dict() for r in actual]
        moved = [r.rank for r in actual if intended.get(r.rank, {}).get("node_id") not in (None, r.node_id)]
        if moved:
            self._event("placement_mismatch", f"ranks {moved} landed off their planned nodes", ranks=moved)
        self._begin_attempt(actual)
        self._event("started", f"{len(actual)} ranks started (attempt {self.restarts + 1})",
                    placement=self.placement, attempt=self.restarts + 1)
        return self._to(ControllerState.RUNNING, "ranks training")

    def _begin_attempt(self, actual: Collection[Any]) -> None:
        self._rank_node = {r.rank: r.node_name for r in actual}
        now = self._clock()
        self._last_seen = {r.rank: now for r in actual}
        self._ckpt_saved = {}
        self._ckpt_open = None
        self._attempt_step = 0
        self._integrity = None
        self._markers = {}
        self._failed_since = None
        self._restored_seen = False
        self.straggler.reset(len(actual))
        self._resume = True  # every later start continues from the last checkpoint

    def _on_running(self) -> Transition | None:
        status = self.wg.poll()
        now = self._clock()
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for rank, ev in inbox:
            if rank in status.ranks:
                status.ranks[rank].events.insert(0, ev)
        self._ingest(status, now)
        failure = self._detect(status, now)
        if failure is not None:
            return self._on_failure(failure)
        if status.all_finished:
            self.result = self._final_result(status)
            self.wg.shutdown()
            self._event("finished", f"finished at step {self.result.get('final_step')}", result=self.result)
            return self._to(ControllerState.FINISHED, "all ranks finished")
        if self._ckpt_open is not None and self.state == ControllerState.RUNNING:
            return self._to(ControllerState.CHECKPOINTING, f"saving the checkpoint of step {self._ckpt_open}")
        if self._ckpt_open is None and self.state == ControllerState.CHECKPOINTING:
            return self._to(ControllerState.RUNNING, "checkpoint committed")
        return None

    def _on_recovering(self) -> Transition:
        # A fault whose step the job passed has fired (a killed rank may not have said so).
        reached = self.progress["step"] or 0
        self._pending_faults = [f for f in self._pending_faults if int(f.get("at_step", 0)) > reached]
        self.restarts += 1
        self._resume = True
        cause = str(self._failure.kind) if self._failure else "unknown"
        self._scrub_candidates()
        expected = self.ckpts.expected_restore()
        common = {"restarts": self.restarts, "cause": cause, "restore_step": expected,
                  "restore_steps": sorted(self._restore_steps() or []),
                  "exclude_nodes": sorted(self._exclude)}
        if self._fast_ranks:
            ranks, self._fast_ranks = self._fast_ranks, []
            try:
                actual = self.wg.replace_ranks(ranks, self.run_cfg, faults=list(self._pending_faults),
                                               restore_steps=self._restore_steps())
            except (WorkerGroupError, PlacementError) as e:
                self._event("fast_path_failed", f"replacing ranks {ranks} failed, restarting all: {e}")
            else:
                self.clock.restarted(cause, "fast")
                self.placement = [r.to_dict() for r in actual]
                self._begin_attempt(actual)
                self._event("restart", f"restart {self.restarts} (fast path): replaced ranks {ranks}, "
                            f"the others kept their processes; resuming from step {expected}",
                            path="fast", replaced=ranks, placement=self.placement, **common)
                return self._to(ControllerState.RUNNING, "ranks replaced")
        self.wg.shutdown()
        self.clock.restarted(cause, "full")
        self._event("restart", f"restart {self.restarts}: re-placing every rank, resuming from step "
                    f"{expected}", path="full", **common)
        return self._to(ControllerState.PLACING, "re-placing after a failure")

    _handlers: dict[ControllerState, Callable[[ControllerStateMachine], Transition | None]] = {
        ControllerState.INIT: _on_init,
        ControllerState.PLACING: _on_placing,
        ControllerState.WAITING: _on_waiting,
        ControllerState.STARTING: _on_starting,
        ControllerState.RUNNING: _on_running,
        ControllerState.CHECKPOINTING: _on_running,
        ControllerState.RECOVERING: _on_recovering,
    }

    # ---- ranks' reports ----------------------------------------------------------------------------
    def _ingest(self, status: GroupStatus, now: float) -> None:
        every = self.run_cfg.checkpoint.every_steps
        ckpt_on = bool(self.run_cfg.checkpoint.dir) and not self.run_cfg.checkpoint.async_save
        world = len(status.ranks)
        merged = []
        for rank, s in status.ranks.items():
            if s.state != "unresponsive":
                self._last_seen[rank] = now
            merged += [(float(ev.get("t") or 0.0), rank, i, ev) for i, ev in enumerate(s.events)]
        # One story across ranks: in the order things happened (the ranks' wall clocks).
        for _, rank, _, ev in sorted(merged, key=lambda item: item[:3]):
            kind = ev.get("kind")
            if kind == "step":
                self._on_step_event(rank, ev)
                step = ev.get("step")
                if isinstance(step, int):
                    self._markers[rank] = (step, 0)
                if ckpt_on and isinstance(step, int) and self._ckpt_open is None and (
                    (every and step % every == 0) or step == self.run_cfg.steps
                ):
                    self._ckpt_open = step
            elif kind == "collective":
                step = int(ev.get("step", 0))
                entered = ev.get("name") == "checkpoint"
                self._markers[rank] = (step, 2 if entered else 1)
                if not entered:
                    found = self.straggler.arrive(step, rank, float(ev.get("t", now)))
                    if found is not None and self._straggler is None:
                        self._straggler = found
            elif kind == "checkpoint":
                step = int(ev["step"])
                saved = self._ckpt_saved.setdefault(step, set())
                saved.add(rank)
                if len(saved) == world:
                    self.progress["last_checkpoint_step"] = step
                    self._event("checkpoint_saved", f"checkpoint of step {step} committed",
                                step=step, path=ev.get("path"), bytes=ev.get("bytes"),
                                seconds=ev.get("seconds"), verified=step in self.ckpts.verified)
                    self._on_checkpoint_committed(step, str(ev.get("path") or ""))
                    if self._ckpt_open is not None and self._ckpt_open <= step:
                        self._ckpt_open = None
            elif kind == "verified":
                self.ckpts.mark_verified(int(ev["step"]))
            elif kind == "restored" and not self._restored_seen:
                self._on_restored(ev.get("step"))
            elif kind == "integrity_error" and self._integrity is None:
                # Every rank raises the same agreed error; record it once.
                self._integrity = {k: ev.get(k) for k in ("error_kind", "step", "ranks", "evidence")}
                message = ev.get("message", "integrity check failed")
                self._event("integrity_error", message, **self._integrity)
            elif kind == "fault_injected":
                self._on_fault_fired(rank, ev)
            elif kind == "started" and rank == 0:
                self._event("rendezvous", f"process group up ({ev.get('backend')} on {ev.get('device')})",
                            backend=ev.get("backend"), device=ev.get("device"))

    def _on_step_event(self, rank: int, ev: Mapping[str, Any]) -> None:
        step = ev.get("step")
        if isinstance(step, int) and isinstance(ev.get("data_positions"), list):
            self.data.record(step, ev["data_positions"], ev.get("step_time_s"), int(ev.get("dp") or 0))
        if rank == 0 and isinstance(ev.get("step_time_s"), int | float):
            times = self.straggler.step_times
            times.append(float(ev["step_time_s"]))
            del times[:-50]
        # Within an attempt steps only grow; a restart resumes from its checkpoint, so the
        # progress may step back to it.
        if not isinstance(step, int) or step < self._attempt_step:
            return
        if self.clock.recovering and step > self._attempt_step:
            took = self.clock.resumed(float(ev.get("t") or self._wall()))
            if took is not None:
                self._event("resumed", f"training resumed: step {step} done {took:.1f}s after the detection",
                            step=step, time_to_recover_s=took)
        self._attempt_step = step
        p = self.progress
        p["step"] = step
        for key in ("loss", "tokens_per_s", "mfu", "step_time_s"):
            if ev.get(key) is not None:
                p[key] = ev[key]

    def _detect(self, status: GroupStatus, now: float) -> Failure | None:
        step = self.progress["step"]
        dead = status.in_state("dead")
        if dead:
            return self._death(dead, status, step)
        failed = status.in_state("failed")
        if failed and self._integrity is not None:
            # The engine's checks (NaN/Inf, loss spike, divergent DP replicas) name the ranks.
            info = self._integrity
            culprits = tuple(info.get("ranks") or failed)
            return Failure(FailureKind.SDC, f"integrity check {info.get('error_kind')} failed at step "
                           f"{info.get('step')} on rank(s) {list(culprits)}", culprits, self._nodes(culprits),
                           info.get("step"), evidence=dict(info))
        o = self.options
        unresponsive = status.in_state("unresponsive")
        if failed and unresponsive:
            # Peers of a rank that is gone fail in their collectives first: blame the silent one.
            self._failed_since = self._failed_since or now
            if now - self._failed_since < o.failure_grace_s:
                return None
            return self._death(unresponsive, status, step)
        if failed:
            first = status.ranks[failed[0]]
            return Failure(FailureKind.RANK_ERROR, f"rank(s) {failed} failed: {first.error}",
                           tuple(failed), self._nodes(failed), step)
        gone = [r for r in unresponsive if self._node_gone(r)]
        if gone:
            return self._death(gone, status, step)
        silent = [r for r in unresponsive if now - self._last_seen.get(r, now) > o.hang_timeout_s]
        if silent:
            return Failure(FailureKind.HANG, f"rank(s) {silent} unresponsive for over "
                           f"{o.hang_timeout_s:.0f}s",
                           tuple(silent), self._nodes(silent), step)
        stale = [
            r for r, s in status.ranks.items()
            if s.state == "running"
            and s.since_progress_s > self._progress_timeout(s.stepped)
        ]
        if stale:
            return self._hang(stale, status, step)
        if self._straggler is not None:
            found, self._straggler = self._straggler, None
            rank = int(found["rank"])
            return Failure(FailureKind.STRAGGLER, f"rank {rank} reached the step's collective last by "
                           f"{found['lags'][-1]['lag_s']:.1f}s for {len(found['lags'])} steps in a row",
                           (rank,), self._nodes([rank]), step, evidence=found)
        return None

    def _progress_timeout(self, stepped: bool) -> float:
        o = self.options
        if not stepped:
            return o.startup_timeout_s
        # A save runs between two steps and may outlast the heartbeat timeout.
        if self._ckpt_open is not None:
            return max(o.hang_timeout_s, o.checkpoint_timeout_s)
        return o.hang_timeout_s

    def _nodes(self, ranks: Collection[int]) -> tuple[str, ...]:
        return tuple(sorted({self._rank_node[r] for r in ranks if r in self._rank_node}))

    def _final_result(self, status: GroupStatus) -> dict[str, Any]:
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
            "restarts": self.restarts,
            "layout": self.run_cfg.layout.to_dict(),
            "data_positions": self.data.summary(),
            "faults": self.fault_stats(),
        }

    # ---- the event log and what the service reads ----------------------------------------------------
    def _event(self, kind: str, message: str, **data: Any) -> None:
        with self._lock:
            self._seq += 1
            self.events.append({"seq": self._seq, "ts": self._wall(), "kind": kind, "message": message,
                                "state": str(self.state), **data})
            if len(self.events) > self.options.max_events:
                del self.events[: len(self.events) - self.options.max_events]

    def _to(self, new: ControllerState, reason: str, *, quiet: bool = False) -> Transition:
        old = self.state
        if not quiet:
            self._event("state", f"{old} -> {new}: {reason}", from_state=str(old), to_state=str(new))
        self.state = new
        log.info("job %s: %s -> %s (%s)", self.job_id, old, new, reason)
        return Transition(old, new, reason)

    @property
    def last_seq(self) -> int:
        return self._seq

    def snapshot(self, since_seq: int = 0) -> dict[str, Any]:
        with self._lock:
            return {
                "job_id": self.job_id,
                "state": str(self.state),
                "job_state": JOB_STATE[self.state],
                "terminal": self.state.terminal,
                "events": [dict(e) for e in self.events if e["seq"] > since_seq],
                "last_seq": self._seq,
                "progress": dict(self.progress),
                "placement": [dict(r) for r in self.placement],
                "result": dict(self.result) if self.result else None,
                "reason": self.reason,
                "restarts": self.restarts,
                "layout": self.run_cfg.layout.to_dict(),
                "suspect_nodes": self.suspect_nodes,
                "quarantined_nodes": self.quarantined_nodes,
                "node_health": dict(self.nodes.health),
                "faults": self.fault_stats(),
            }
