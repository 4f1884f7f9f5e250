"""The job controller's state machine: pure logic, driven one `step()` at a time.

`step()` does one iteration and returns the `Transition` it made (or None). The machine talks to the
ranks only through a `WorkerGroup` and to the world through policies and injected clocks, so tests
drive it one transition at a time against a dummy group. `snapshot(since_seq)` is all the service
reads. Fault handling is delegated to owned collaborators: detection (`detection`), attribution and
the node ledger (`Attributor`), injection (`FaultInjector`), checkpoint scrubbing
(`CheckpointScrubber`); the ranks' reports are read by `ingest`; a restart is `recovering`'s: the fast
path replaces only the lost ranks (from their DP peers' memory when it can, else the last *verified*
checkpoint), otherwise every rank is re-placed. `workers.controller.actor.JobController` runs this
loop in a Ray actor.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from typing import Any

from training.config.run import RunConfig
from workers.collective_trace import annotate_hang
from workers.controller import classify, detection, elastic, ingest, preempt, recovering
from workers.controller.attempt import Attempt
from workers.controller.attribution import Attributor, Referee
from workers.controller.eventlog import EventLog
from workers.controller.injection import FaultInjector
from workers.controller.options import ControllerOptions
from workers.controller.records import Clocks, FaultBooks, JobRecord, PlacementRetry, Policies, Recovery
from workers.controller.scrub import CheckpointOps, CheckpointScrubber
from workers.controller.state import JOB_STATE, ControllerState, Transition
from workers.events import EventKind, FailureReport, Placed, StateChange
from workers.fault_ledger import CheckpointLedger, StragglerWatch
from workers.placement import PlacementError, place
from workers.policies import (
    Failure,
    FailureAction,
    FailureClass,
    FailureDecision,
    FailureKind,
    FailurePolicy,
    HoldLayoutPolicy,
    RestartPolicy,
    ScalingAction,
    ScalingPolicy,
)
from workers.topology import Topology
from workers.worker_group import WorkerGroup, WorkerGroupError

log = logging.getLogger(__name__)


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
        node_killer: Callable[[str], None] | None = None,
        checkpoint_ops: CheckpointOps | None = None,
        referee: Referee | None = None,
    ) -> None:
        """`node_killer(name)` removes a node (kill_node faults); `checkpoint_ops` has
        `verify(path)` (raises on a damaged checkpoint), `corrupt(path, which, mode)` and optionally
        `list(root)`; `referee(run_cfg, request, exclude_nodes)` replays a step on a spare."""
        opts = options or ControllerOptions()
        self.job_id = job_id
        self.run_cfg = run_cfg
        self.wg = worker_group
        self.options = opts
        self.policies = Policies(failure_policy or RestartPolicy(), scaling_policy or HoldLayoutPolicy())
        self.clocks = Clocks(clock, wall_clock)
        self.state = ControllerState.INIT
        self.log = EventLog(opts.first_seq, opts.max_events, wall_clock, lambda: str(self.state))
        self.job = JobRecord.new(run_cfg.steps)
        self.attempt = Attempt()
        self.recovery = Recovery(resume=opts.resume)
        self.retry = PlacementRetry()
        self.books = FaultBooks(wall_clock(), straggler=StragglerWatch(
            opts.straggler_lag_s, opts.straggler_factor, opts.straggler_steps))
        ckpts = CheckpointLedger(run_cfg.checkpoint.dir)
        ckpts.load()
        self.scrubber = CheckpointScrubber(ckpts, checkpoint_ops, self.log, self.books.clock, wall_clock,
                                           on_damaged=self._request_fresh_checkpoint)
        self.history = classify.FailureHistory()
        self.attributor = Attributor(self.log, job_id=job_id, quarantine_after=opts.quarantine_after,
                                     quarantine_jobs=opts.quarantine_jobs, fast_path=opts.fast_path,
                                     use_referee=opts.referee, health=health, cordoned=cordoned,
                                     referee=referee)
        self.injector = FaultInjector(opts.faults, worker_group, self.log, self.books.clock, self.scrubber,
                                      wall_clock, node_killer)
        self.preemption: preempt.PreemptNotice | None = None  # a notice (workers.controller.preempt)
        self.growth = elastic.setup(self.policies.scaling, run_cfg.layout)  # growing back (elastic jobs)

    # ---- the loop body ---------------------------------------------------------------------------
    def step(self) -> Transition | None:
        if self.state.terminal:
            return None
        reason = self.job.cancel_reason
        if reason is not None:
            try:
                self.wg.shutdown()
            except Exception:  # cancelled either way; the actors die with the controller
                log.exception("job %s: worker group shutdown failed on cancel", self.job_id)
            self.job.reason = reason
            self.log.emit(EventKind.CANCELLED, reason)
            return self._to(ControllerState.CANCELLED, reason)
        try:
            if self.preemption is not None and not self.state.training:
                return preempt.stop_now(self)
            return self._handlers[self.state](self)
        except Exception as e:  # a controller bug must end the job, not hang it
            log.exception("job %s: controller error in %s", self.job_id, self.state)
            return self.fail(f"controller error in {self.state}: {type(e).__name__}: {e}",
                             traceback.format_exc()[-4000:])

    def fail(self, reason: str, detail: str | None = None, **evidence: Any) -> Transition | None:
        """End the job with `reason`; `evidence` (classification, traceback) joins the error event."""
        if self.state.terminal:
            return None
        try:
            self.wg.shutdown()
        except Exception as e:  # the job fails either way; say why teardown failed too
            log.exception("job %s: worker group shutdown failed", self.job_id)
            detail = f"{detail or ''}\nshutdown failed: {type(e).__name__}: {e}".strip()
        self.job.reason = reason
        self.job.traceback = evidence.get("traceback") or self.job.traceback
        self.log.emit(EventKind.ERROR, reason, **({"detail": detail} if detail else {}), **evidence)
        return self._to(ControllerState.ERRORED, reason)

    def request_cancel(self, reason: str = "cancelled by user") -> None:
        if not self.state.terminal and self.job.cancel_reason is None:
            self.job.cancel_reason = reason

    @property
    def cancel_requested(self) -> bool:
        return self.job.cancel_reason is not None

    def update_nodes(self, health: Mapping[str, str], cordoned: Collection[str]) -> None:
        """The service's health ledger and cordon set changed; used from the next placement on."""
        with self.log.lock:
            self.attributor.health = dict(health)
            self.attributor.cordoned = set(cordoned)

    # ---- calls from other threads (the actor's methods) --------------------------------------------
    def report(self, rank: int, event: Mapping[str, Any]) -> None:
        """An event a rank sent directly (e.g. just before it kills itself); read with the next poll."""
        self.log.deliver(rank, dict(event))

    def inject(self, fault: Mapping[str, Any]) -> None:
        """Add a fault while the job runs (POST /v1/jobs/{id}/faults)."""
        f = self.injector.add(fault)
        if self.state.training:
            params = {k: v for k, v in f.items() if k not in ("kind", "rank", "at_step")}
            self.wg.inject_fault(f["kind"], int(f.get("rank") or 0), f["at_step"], **params)

    def trigger(self, rank: int, fault: Mapping[str, Any]) -> str:
        """Carry out a controller-side fault a rank reached (kill_node, corrupt_checkpoint); called
        from the rank, which waits (a kill_node of its own node never returns to it)."""
        return self.injector.trigger(rank, fault, self.attempt.rank_node)

    # ---- states ------------------------------------------------------------------------------------
    def _on_init(self) -> Transition:
        self.log.emit(EventKind.CONTROLLER_STARTED, f"controller for job {self.job_id} started",
                      layout=self.run_cfg.layout.to_dict())
        return self._to(ControllerState.PLACING, "placing the ranks")

    def _on_placing(self) -> Transition:
        if self.retry.since is None:
            self.retry.since = self.clocks.monotonic()
        layout, exclude = self.run_cfg.layout, self.attributor.exclude
        topology = self.wg.topology(self.attributor.health_view(), self.attributor.cordoned)
        try:
            try:
                placement = place(layout, topology, exclude_nodes=exclude)
            except PlacementError:
                if not exclude:
                    raise
                # Avoiding the failed nodes is a preference; use them rather than not run.
                placement = place(layout, topology)
            self.wg.reserve(placement)
        except PlacementError as e:
            return self._unplaceable(str(e), topology)
        self.retry.placed()
        self.job.placement = placement.to_list()
        self.log.emit(EventKind.PLACED, f"{placement.world_size} ranks reserved on "
                      f"{len(placement.by_node())} nodes ({layout.describe()})",
                      Placed(self.job.placement, list(placement.notes)))
        return self._to(ControllerState.STARTING, "placement group ready")

    def _unplaceable(self, reason: str, topology: Topology) -> Transition | None:
        retry = self.retry
        retry.attempts += 1
        waited = self.clocks.monotonic() - (retry.since or self.clocks.monotonic())
        decision = self.policies.scaling.on_unplaceable(
            reason, self.run_cfg.layout, topology, retry.attempts, waited
        )
        if decision.action == ScalingAction.REPLAN and decision.layout is not None:
            old = self.run_cfg.layout
            self.run_cfg = dataclasses.replace(self.run_cfg, layout=decision.layout)
            new = decision.layout.to_dict()
            diff = {k: [v, new[k]] for k, v in old.to_dict().items() if new.get(k) != v}
            self.log.emit(EventKind.REPLANNED, decision.reason, old=old.describe(),
                          new=decision.layout.describe(), old_layout=old.to_dict(), new_layout=new, diff=diff,
                          global_batch_kept=old.global_batch == decision.layout.global_batch)
            return self._to(ControllerState.PLACING, "placing the re-planned layout")
        if decision.action == ScalingAction.FAIL:
            return self.fail(decision.reason)
        retry.retry_at = self.clocks.monotonic() + decision.retry_after_s
        self.job.reason = reason
        quiet = reason == retry.last_reason
        if not quiet:
            self.log.emit(EventKind.PLACEMENT_FAILED, reason, attempts=retry.attempts)
        retry.last_reason = reason
        return self._to(ControllerState.WAITING, reason, quiet=quiet)

    def _on_waiting(self) -> Transition | None:
        if self.clocks.monotonic() < self.retry.retry_at:
            return None
        return self._to(ControllerState.PLACING, "retrying placement", quiet=True)

    def restore_steps(self) -> set[int] | None:
        """The checkpoints the next start may restore (None: any valid one, or no resume)."""
        return self.scrubber.ledger.restore_steps() if self.recovery.resume else None

    def _on_starting(self) -> Transition | None:
        try:
            actual = self.wg.start(self.run_cfg, resume=self.recovery.resume,
                                   faults=list(self.injector.pending), restore_steps=self.restore_steps(),
                                   rerun_spikes=self.recovery.spikes_to_rerun(self.run_cfg.layout))
        except (WorkerGroupError, PlacementError) as e:
            return self._on_failure(Failure(FailureKind.STARTUP, str(e)))
        intended = {r["rank"]: r for r in self.job.placement}
        self.job.placement = [r.to_dict() for r in actual]
        moved = [r.rank for r in actual if intended.get(r.rank, {}).get("node_id") not in (None, r.node_id)]
        if moved:
            self.log.emit(EventKind.PLACEMENT_MISMATCH, f"ranks {moved} landed off their planned nodes",
                          ranks=moved)
        self._begin_attempt(actual)
        attempt = self.job.restarts + 1
        self.log.emit(EventKind.STARTED, f"{len(actual)} ranks started (attempt {attempt})",
                      placement=self.job.placement, attempt=attempt)
        return self._to(ControllerState.RUNNING, "ranks training")

    def _begin_attempt(self, actual: Collection[Any]) -> None:
        self.attempt = Attempt.begin(actual, self.clocks.monotonic())
        self.books.straggler.reset(len(actual))
        self.recovery.resume = True  # every later start continues from the last checkpoint

    def _on_running(self) -> Transition | None:
        status = self.wg.poll()
        now = self.clocks.monotonic()
        for rank, ev in self.log.take_delivered():
            if rank in status.ranks:
                status.ranks[rank].events.insert(0, ev)
        ingest.ingest(self, status, now)
        self._blame_transients()
        failure = detection.detect(status, now, self.attempt, self.options, self.job.progress["step"],
                                   self._node_gone, self.recovery.straggler,
                                   self.books.straggler.typical_step_s())
        if failure is not None:
            if failure.kind == FailureKind.STRAGGLER:
                self.recovery.straggler = None
            return self._on_failure(failure)
        if self.preemption is not None and (stopped := preempt.on_poll(self, status, now)) is not None:
            return stopped
        if self.growth is not None and (grown := elastic.on_poll(self, status, now)) is not None:
            return grown
        if status.all_finished:
            result = self.job.result = ingest.final_result(self, status)
            self.wg.shutdown()
            self.log.emit(EventKind.FINISHED, f"finished at step {result.get('final_step')}", result=result)
            return self._to(ControllerState.FINISHED, "all ranks finished")
        ckpt_open = self.attempt.ckpt_open
        if ckpt_open is not None and self.state == ControllerState.RUNNING:
            return self._to(ControllerState.CHECKPOINTING, f"saving the checkpoint of step {ckpt_open}")
        if ckpt_open is None and self.state == ControllerState.CHECKPOINTING:
            return self._to(ControllerState.RUNNING, "checkpoint committed")
        return None

    def _blame_transients(self) -> None:
        """A restart's re-run of a gradient spike changed the norms: the first attempt's were corrupt,
        a transient fault of those ranks' nodes then, counted against them now (suspect)."""
        recovery = self.recovery
        for step, ranks in recovery.transients:
            nodes = tuple(sorted({n for r, n in recovery.rerun_nodes.get(step, {}).items() if r in ranks}))
            evidence = {"error_kind": "gradient_rerun", "step": step,
                        "evidence": {"transient": True, "attribution": "the restart re-ran it: other norms"}}
            failure = Failure(FailureKind.SDC, f"step {step}'s gradient did not reproduce on rank(s) {ranks}",
                              tuple(ranks), nodes, step, evidence, FailureClass.INFRASTRUCTURE)
            self.attributor.attribute(failure, FailureDecision(FailureAction.RETRY, "after the fact",
                                                               suspect_nodes=nodes))
        recovery.transients.clear()

    def _node_gone(self, node: str) -> bool:
        return node in self.injector.dead_nodes or not self.wg.node_alive(node)

    def _request_fresh_checkpoint(self) -> None:
        """A committed checkpoint is damaged: replace it with a good one at the next step."""
        if self.state.training:
            self.wg.request_action("checkpoint")

    def _on_failure(self, failure: Failure) -> Transition | None:
        """Classify the failure (workers.controller.classify), then let the policy decide: a job error
        fails the job blaming nobody, an unknown one restarts blaming nobody, an infrastructure
        fault restarts and counts against its nodes; the crash-loop breaker overrides a restart."""
        self.recovery.failure = failure
        if self.recovery.peer_step is not None and not self.attempt.stepped:
            self.recovery.peer_failed = True  # the peer transfer itself may be at fault
        attributor = self.attributor
        if failure.kind == FailureKind.STRAGGLER and self.options.straggler_action == "report":
            self.log.emit(EventKind.STRAGGLER, failure.message, failure=failure.to_dict())
            for n in failure.nodes:
                attributor.mark_node(n, failure)
            return None
        if failure.kind == FailureKind.HANG:  # each rank's last collective, from its flight recorder
            failure = annotate_hang(failure, self.run_cfg.checkpoint.dir,
                                    range(self.run_cfg.layout.world_size), self.wg.dump_collectives)
        failure = classify.classify(failure, self.attempt, self.history)
        spike = classify.spike_to_rerun(failure)
        if spike is not None:  # the restart re-runs it (training.integrity.settle)
            step, norms = spike
            nodes = {r: self.attempt.rank_node[r] for r in norms if r in self.attempt.rank_node}
            self.recovery.note_spike(step, norms, nodes, self.run_cfg.layout)
        stalled = classify.note_progress(self.history, self.attempt)
        report = classify.rank_report(failure, self.attempt) or {}
        evidence = {"classification": str(failure.failure_class), "classification_reason": failure.why,
                    **({"traceback": report["traceback"]} if report.get("traceback") else {})}
        incident = self.books.clock.detected(str(failure.kind), self.clocks.wall())
        self.recovery.reached = self.attempt.step or (self.job.progress["step"] or 0)
        detected_by = detection.DETECTED_BY.get(failure.kind, str(failure.kind))
        self.log.emit(EventKind.FAILURE, failure.message,
                      FailureReport(failure.to_dict(), detected_by, incident["time_to_detect_s"]),
                      attempts_without_progress=stalled, **evidence)
        if failure.kind == FailureKind.SDC and failure.blames_nodes:
            refereed = attributor.ask_referee(failure, self.run_cfg, self.attempt)
            failure = dataclasses.replace(refereed, classification=failure.classification, why=failure.why)
        self.recovery.failure = failure
        decision = self.policies.failure.decide(failure, self.job.restarts)
        crash_loop = classify.crash_loop_reason(self.history, self.options.crash_loop_attempts, failure)
        if crash_loop is not None and decision.action == FailureAction.RETRY:
            decision = dataclasses.replace(decision, action=FailureAction.RAISE, reason=crash_loop)
        if failure.blames_nodes:
            attributor.attribute(failure, decision)
        if decision.action == FailureAction.RAISE:
            if failure.failure_class == FailureClass.JOB_ERROR:
                self.log.emit(EventKind.JOB_ERROR, decision.reason, failure=failure.to_dict(), **evidence)
            return self.fail(decision.reason, **evidence)
        attributor.avoid(failure, decision)
        self.recovery.fast_ranks = attributor.fast_path_ranks(failure)
        return self._to(ControllerState.RECOVERING, decision.reason)

    def _on_recovering(self) -> Transition:
        return recovering.recover(self)

    _handlers: dict[ControllerState, Callable[[ControllerStateMachine], Transition | None]] = {
        ControllerState.INIT: _on_init,
        ControllerState.PLACING: _on_placing,
        ControllerState.WAITING: _on_waiting,
        ControllerState.STARTING: _on_starting,
        ControllerState.RUNNING: _on_running,
        ControllerState.CHECKPOINTING: _on_running,
        ControllerState.RECOVERING: _on_recovering,
    }

    def _to(self, new: ControllerState, reason: str, *, quiet: bool = False) -> Transition:
        old = self.state
        if not quiet:
            self.log.emit(EventKind.STATE, f"{old} -> {new}: {reason}", StateChange(str(old), str(new)))
        if new.terminal:  # before the state says so: whoever collects the job may end this process
            try:
                self.wg.close()
            except Exception:  # the job has ended either way
                log.exception("job %s: worker group close failed", self.job_id)
        self.state = new
        log.info("job %s: %s -> %s (%s)", self.job_id, old, new, reason)
        return Transition(old, new, reason)

    # ---- what the service reads --------------------------------------------------------------------
    @property
    def events(self) -> list[dict[str, Any]]:
        return self.log.events

    @property
    def last_seq(self) -> int:
        return self.log.seq

    @property
    def reason(self) -> str | None:
        return self.job.reason

    @property
    def restarts(self) -> int:
        return self.job.restarts

    @property
    def suspect_nodes(self) -> list[str]:
        return self.attributor.suspect_nodes

    @property
    def quarantined_nodes(self) -> list[str]:
        return self.attributor.quarantined_nodes

    def snapshot(self, since_seq: int = 0) -> dict[str, Any]:
        with self.log.lock:
            job = self.job
            return {
                "job_id": self.job_id,
                "state": str(self.state),
                "job_state": JOB_STATE[self.state],
                "terminal": self.state.terminal,
                "events": self.log.since(since_seq),
                "last_seq": self.log.seq,
                "progress": dict(job.progress),
                "placement": [dict(r) for r in job.placement],
                "result": dict(job.result) if job.result else None,
                "reason": job.reason,
                "traceback": job.traceback,
                "restarts": job.restarts,
                "layout": self.run_cfg.layout.to_dict(),
                "suspect_nodes": self.suspect_nodes,
                "quarantined_nodes": self.quarantined_nodes,
                "node_health": dict(self.attributor.nodes.health),
                "faults": self.fault_stats(),
                "spares": self.wg.describe_spares(),  # workers.spares: job, node, rack, state, age_s
                "warm_processes": self.wg.describe_warm(),  # workers.warm_workers: node id -> count
            }

    def fault_stats(self) -> dict[str, Any]:
        """Fault-tolerance metrics: the books' (workers.controller.records) and the checkpoints'."""
        return {**self.books.stats(self.clocks.wall(), self.attributor.nodes), **self.scrubber.stats()}
