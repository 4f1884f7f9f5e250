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

from training.config import RunConfig
from workers.placement import PlacementError, place
from workers.policies import (
    Failure,
    FailureAction,
    FailureKind,
    FailurePolicy,
    HoldLayoutPolicy,
    RestartPolicy,
    ScalingAction,
    ScalingPolicy,
)
from workers.rank import DEFAULT_TRAIN_FN
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
    # Rank faults to inject (issue 6): {"kind": "kill_rank"|"hang_rank"|"slow_rank", "rank", "at_step"};
    # each fires once over the job's life, re-armed after a restart until it has fired.
    faults: tuple[Mapping[str, Any], ...] = ()
    env_vars: Mapping[str, str] = field(default_factory=dict)


class ControllerStateMachine:
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
    ) -> None:
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
        self._suspect: set[str] = set()
        self._quarantined: set[str] = set()
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
        self._pending_faults: list[dict[str, Any]] = [dict(f) for f in self.options.faults]

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
        for n in self._suspect:
            if view.get(n, "ready") == "ready":
                view[n] = "suspect"
        for n in self._quarantined:
            view[n] = "quarantined"
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
            self._event("replanned", decision.reason, old=old.describe(), new=decision.layout.describe(),
                        old_layout=old.to_dict(), new_layout=decision.layout.to_dict())
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

    def _on_starting(self) -> Transition:
        try:
            actual = self.wg.start(self.run_cfg, resume=self._resume, faults=list(self._pending_faults))
        except (WorkerGroupError, PlacementError) as e:
            return self._on_failure(Failure(FailureKind.STARTUP, str(e)))
        intended = {r["rank"]: r for r in self.placement}
        self.placement = [r.to_dict() for r in actual]
        moved = [r.rank for r in actual if intended.get(r.rank, {}).get("node_id") not in (None, r.node_id)]
        if moved:
            self._event("placement_mismatch", f"ranks {moved} landed off their planned nodes", ranks=moved)
        self._rank_node = {r.rank: r.node_name for r in actual}
        now = self._clock()
        self._last_seen = {r.rank: now for r in actual}
        self._ckpt_saved = {}
        self._ckpt_open = None
        self._attempt_step = 0
        self._integrity = None
        self._resume = True  # every later start continues from the last checkpoint
        self._event("started", f"{len(actual)} ranks started (attempt {self.restarts + 1})",
                    placement=self.placement, attempt=self.restarts + 1)
        return self._to(ControllerState.RUNNING, "ranks training")

    def _on_running(self) -> Transition | None:
        status = self.wg.poll()
        now = self._clock()
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
        self.wg.shutdown()
        # A killed rank cannot report that its fault fired; the steps the job reached can.
        reached = self.progress["step"] or 0
        self._pending_faults = [f for f in self._pending_faults if int(f.get("at_step", 0)) > reached]
        self.restarts += 1
        self._resume = True
        self._event("restart", f"restart {self.restarts}: resuming from the last checkpoint",
                    restarts=self.restarts, exclude_nodes=sorted(self._exclude))
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
        for rank, s in status.ranks.items():
            if s.state != "unresponsive":
                self._last_seen[rank] = now
            for ev in s.events:
                kind = ev.get("kind")
                if kind == "step":
                    self._on_step_event(ev)
                    step = ev.get("step")
                    if ckpt_on and isinstance(step, int) and self._ckpt_open is None and (
                        (every and step % every == 0) or step == self.run_cfg.steps
                    ):
                        self._ckpt_open = step
                elif kind == "checkpoint":
                    step = int(ev["step"])
                    saved = self._ckpt_saved.setdefault(step, set())
                    saved.add(rank)
                    if len(saved) == world:
                        self.progress["last_checkpoint_step"] = step
                        self._event("checkpoint_saved", f"checkpoint of step {step} committed",
                                    step=step, path=ev.get("path"), bytes=ev.get("bytes"),
                                    seconds=ev.get("seconds"))
                        if self._ckpt_open is not None and self._ckpt_open <= step:
                            self._ckpt_open = None
                elif kind == "integrity_error" and self._integrity is None:
                    # Every rank raises the same agreed error; record it once.
                    self._integrity = {k: ev.get(k) for k in ("error_kind", "step", "ranks", "evidence")}
                    message = ev.get("message", "integrity check failed")
                    self._event("integrity_error", message, **self._integrity)
                elif kind == "fault_injected":
                    fault, at = ev.get("fault"), ev.get("step")
                    self._pending_faults = [
                        f for f in self._pending_faults if (f.get("kind"), f.get("rank")) != (fault, rank)
                    ]
                    self._event("fault_injected", f"{fault} on rank {rank} at step {at}",
                                rank=rank, fault=fault, step=at)
                elif kind == "started" and rank == 0:
                    self._event("rendezvous", f"process group up ({ev.get('backend')} on {ev.get('device')})",
                                backend=ev.get("backend"), device=ev.get("device"))

    def _on_step_event(self, ev: Mapping[str, Any]) -> None:
        step = ev.get("step")
        # Within an attempt steps only grow; a restart resumes from its checkpoint, so the
        # progress may step back to it.
        if not isinstance(step, int) or step < self._attempt_step:
            return
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
            return Failure(FailureKind.RANK_DIED, f"rank(s) {dead} died: {status.ranks[dead[0]].error}",
                           tuple(dead), self._nodes(dead), step)
        failed = status.in_state("failed")
        if failed and self._integrity is not None:
            # The engine's checks (NaN/Inf, loss spike, divergent DP replicas) name the ranks.
            info = self._integrity
            culprits = tuple(info.get("ranks") or failed)
            return Failure(FailureKind.SDC, f"integrity check {info.get('error_kind')} failed at step "
                           f"{info.get('step')} on rank(s) {list(culprits)}", culprits, self._nodes(culprits),
                           info.get("step"), evidence=dict(info))
        if failed:
            first = status.ranks[failed[0]]
            return Failure(FailureKind.RANK_ERROR, f"rank(s) {failed} failed: {first.error}",
                           tuple(failed), self._nodes(failed), step)
        o = self.options
        silent = [
            r for r in status.in_state("unresponsive") if now - self._last_seen.get(r, now) > o.hang_timeout_s
        ]
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
            # Everyone waits in the collective the hung rank never joined: blame the ranks that
            # stopped earliest (lowest step, then longest silence).
            low = min((status.ranks[r].step or 0) for r in stale)
            behind = [r for r in stale if (status.ranks[r].step or 0) == low]
            longest = max(status.ranks[r].since_progress_s for r in behind)
            culprits = sorted(r for r in behind if status.ranks[r].since_progress_s >= longest - 1.0)
            return Failure(FailureKind.HANG, f"no progress from rank(s) {culprits} for {longest:.0f}s "
                           f"(timeout {self._progress_timeout(True):.0f}s)", tuple(culprits),
                           self._nodes(culprits), step, evidence={"stale_ranks": stale})
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

    def _on_failure(self, failure: Failure) -> Transition | None:
        self._event("failure", failure.message, failure=failure.to_dict())
        decision = self.failure_policy.decide(failure, self.restarts)
        for n in decision.suspect_nodes:
            if n not in self._suspect:
                self._suspect.add(n)
                self._event("node_suspect", f"node {n} is suspect after {failure.kind}", node=n)
        for n in decision.quarantine_nodes:
            if n not in self._quarantined:
                self._quarantined.add(n)
                self._event("node_quarantined", f"node {n} quarantined after {failure.kind}", node=n)
        if decision.action == FailureAction.RAISE:
            return self.fail(decision.reason)
        self._exclude = set(decision.exclude_nodes)
        return self._to(ControllerState.RECOVERING, decision.reason)

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
                "suspect_nodes": sorted(self._suspect),
                "quarantined_nodes": sorted(self._quarantined),
            }
