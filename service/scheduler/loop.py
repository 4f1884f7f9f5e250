"""The scheduler loop: the thread, the API's hooks (wake, cancel, inject_fault, cluster_view), the
attached controllers and what one tick does with them (see the package docstring)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import metrics, store
from service.checkpoint_period import default_checkpoint_period
from service.errors import ConcurrentUpdate, IllegalTransition, NotLeader
from service.scheduler import admission, reconcile
from service.scheduler.attached import Attached, held_gpus
from service.scheduler.autocalibrate import AutoCalibrator, from_settings
from service.scheduler.cluster import free_view, sync_nodes
from service.scheduler.ingest import PLACED_STATES, write_snapshot
from service.scheduler.leader import LeaderElector, Leadership
from service.scheduler.notices import Preemptor, note_resumed
from service.scheduler.observer import JobMetrics, observe_cluster, observe_launch, observe_queue
from service.schemas import JobSpec
from service.settings import Settings
from service.store.models import JobState
from service.store.nodes import ClusterLedger, read_ledger
from training.config.layout import Layout
from workers.client import (
    ClusterUnavailable,
    ControllerBusy,
    ControllerClient,
    ControllerExists,
    ControllerFailed,
    ControllerGone,
    ControllerStartError,
    ControllerState,
    controller_job_ids,
    find_controller,
    kill_controller,
    live_topology,
    start_controller,
)
from workers.placement import Placement, PlacementError, place
from workers.policies import RestartPolicy
from workers.topology import Topology

log = logging.getLogger(__name__)

# A controller whose poll() raises this many times in a row is replaced (the job recovers).
MAX_POLL_ERRORS = 30
class Scheduler:
    """Implements the API's SchedulerHook (`wake`, `cancel`) and `cluster_view` for GET /v1/cluster."""

    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        *,
        read_session_factory: sessionmaker[Session] | None = None,
        controller_defaults: Mapping[str, Any] | None = None,
        interval_s: float | None = None,
        poll_timeout_s: float = 10.0,
        leader: LeaderElector | None = None,
        calibrator: AutoCalibrator | None = None,
    ) -> None:
        self.settings = settings
        # With an elector, the loop acts only while this process holds the lease, and session_factory
        # should be its fenced factory (elector.session_factory); None: always act (one process).
        self._leadership = Leadership(leader, on_elected=self._take_office, on_deposed=self._forget_cluster)
        self._sf = session_factory
        self._rsf = read_session_factory or session_factory
        # Extra ControllerOptions fields for every job (e.g. train_fn in tests, poll_interval_s).
        self._controller_defaults = {"poll_interval_s": 0.2, **dict(controller_defaults or {})}
        self.interval_s = interval_s if interval_s is not None else settings.scheduler_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._attached: dict[str, Attached] = {}
        self._cancels: set[str] = set()
        self._waiting = admission.WaitingNotes(session_factory, self._rsf)
        self._preemptor = Preemptor(session_factory, self._rsf, settings.preempt_notice_dir, poll_timeout_s)
        # Node types without a hardware profile are calibrated in the background (LATTICE_AUTO_CALIBRATE).
        self.calibrator = calibrator or from_settings(settings, session_factory, self._rsf)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._topology: Topology | None = None
        self._ledger: ClusterLedger | None = None
        self._ledger_pushed: ClusterLedger | None = None

    # ---- the API's hooks ---------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The job is already `cancelled` in the store; stop its ranks on the next tick."""
        with self._lock:
            self._cancels.add(job_id)
        self._wake.set()

    def drain(self, node: str, why: str) -> None:
        """The node is cordoned in the store; its jobs get preemption notices on the next tick."""
        self._preemptor.drain(node, why)
        self._wake.set()

    def inject_fault(self, job_id: str, fault: Mapping[str, Any]) -> bool:
        """Hand a fault spec (workers.faults) to the job's controller; False if the job has none here.
        The caller checks settings.fault_injection and the admin role."""
        a = self._attached.get(job_id)
        if a is None:
            return False
        a.controller.inject_fault(fault, timeout_s=self.poll_timeout_s)
        return True

    def cluster_view(self) -> tuple[Topology | None, ClusterLedger | None]:
        """The live topology (health merged) and the ledger as of the last tick."""
        return self._topology, self._ledger

    def spares_view(self) -> list[dict[str, Any]]:
        """The attached jobs' hot spares (workers.spares) as of their last snapshots."""
        return [dict(s) for a in list(self._attached.values()) for s in a.metrics.spares]

    def attached_jobs(self) -> list[str]:
        return sorted(self._attached)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Reconcile with the cluster (once elected, with a leader elector), then run the loop in a
        daemon thread. An uncontested process is elected, and has reconciled, when this returns."""
        if self._leadership.elector is None:
            self.reconcile()
        else:
            self._leadership.elector.start()
            self._leadership.may_act()  # reconciles if this process leads
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="lattice-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop. Controllers are detached: their jobs keep running for the next service."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._attached.clear()
        self._leadership.stop()  # the loop wrote its last: a standby may take over at once

    @property
    def is_leader(self) -> bool:
        return self._leadership.is_leader

    def _take_office(self) -> None:
        self._attached.clear()  # another leader may have acted since: start from the store
        self.reconcile()

    def _forget_cluster(self) -> None:
        self._attached.clear()
        self._topology = self._ledger_pushed = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the loop must survive a bad tick (DB or cluster hiccup); logged
                log.exception("scheduler tick failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def step(self) -> bool:
        """One iteration of the loop: a tick if this process leads (reconciling first in a new term).
        Returns whether it acted; a write refused by the fence steps down."""
        try:
            if not self._leadership.may_act():
                return False
            self.tick()
        except NotLeader as e:  # the fence refused a write: another process leads now
            self._leadership.step_down(str(e))
            return False
        return True

    def tick(self) -> None:
        self._send_cancels()
        self._preemptor.take_notices()
        for job_id in list(self._attached):
            try:
                self._poll(job_id)
            except NotLeader:
                raise
            except Exception:  # one job's trouble must not stall the others; logged
                log.exception("job %s: poll/ingest failed", job_id)
        topology = self._refresh_cluster()
        self._preemptor.tick(self._attached, self._ledger.cordoned if self._ledger else frozenset())
        if self.calibrator.enabled:  # starts a background calibration per new node type, never waits
            self.calibrator.tick(free_view(topology, held_gpus(self._attached.values())))
        hold = self.calibrator.awaiting(self.settings.gpu_type, self.settings.calibration_hold_s)
        admission.admit_pending(self._sf, self._rsf, self.settings, topology, hold=hold, notes=self._waiting)
        self._schedule(topology)
        with self._rsf() as s:
            observe_queue(store.count_jobs_by_state(s))

    # ---- reconcile ---------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Re-attach live controllers of unfinished jobs; recover active jobs whose controller is gone;
        end controllers of jobs the store says are finished."""
        for job_id, state, seq in reconcile.unfinished_jobs(self._rsf):
            controller = find_controller(job_id)
            if controller is not None and controller.responds(seq, self.poll_timeout_s):
                self._attach(job_id, controller, seq, {}, JobMetrics(job_id))
                with store.session_scope(self._sf) as s:
                    store.append_event(s, job_id, "reattached", {"controller": controller.name,
                                                                  "after_seq": seq})
                log.info("job %s: re-attached to its controller after seq %d", job_id, seq)
            elif state in store.ACTIVE_STATES:
                self._recover(job_id, "its controller is gone (found when the service started)")
        self._end_orphans()

    def _end_orphans(self) -> None:
        """A controller of a job that the store says is finished (the service died between the
        commit and ending it, or before a cancel reached it) must not keep running."""
        try:
            job_ids = controller_job_ids()
        except ClusterUnavailable as e:
            log.warning("%s", e)
            return
        for job_id in job_ids:
            if reconcile.is_terminal(self._rsf, job_id):
                log.info("job %s is finished in the store; ending its leftover controller", job_id)
                kill_controller(job_id)

    def _recover(self, job_id: str, why: str) -> None:
        """Start a new controller that resumes from the job's last checkpoint (never run twice: the
        named controller is unique, and the old one, with its ranks, is gone)."""
        relaunch = reconcile.plan_recovery(self._sf, job_id, why)
        if relaunch is None:
            return
        log.warning("job %s: %s; recovering from %s", job_id, why, relaunch.resume)
        self._launch(job_id, JobSpec.model_validate(relaunch.spec), relaunch.seq, {},
                     reached_step=relaunch.reached_step, restarts_used=relaunch.restarts_used)

    # ---- polling attached controllers ------------------------------------------------------------------
    def _attach(self, job_id: str, controller: ControllerClient, seq: int, intended: Mapping[str, int],
                job_metrics: JobMetrics) -> None:
        self._attached[job_id] = Attached(job_id=job_id, controller=controller, seq=seq,
                                          intended=dict(intended), metrics=job_metrics)

    def _poll(self, job_id: str) -> None:
        a = self._attached[job_id]
        try:
            snap = a.controller.poll(a.seq, timeout_s=self.poll_timeout_s)
        except ControllerBusy as e:
            log.warning("%s; retrying next tick", e)
            return
        except ControllerGone as e:
            del self._attached[job_id]
            self._recover(job_id, f"its controller died: {e}")
            return
        except ControllerFailed as e:  # poll() itself raised (a controller bug): do not stall the others
            a.poll_errors += 1
            log.error("job %s: controller poll failed (%d in a row): %s", job_id, a.poll_errors, e)
            if a.poll_errors >= MAX_POLL_ERRORS:
                del self._attached[job_id]
                kill_controller(job_id)
                self._recover(job_id, f"its controller failed {a.poll_errors} polls in a row: {e}"[:500])
            return
        a.poll_errors = 0
        try:
            self._ingest(a, snap)
        except (ConcurrentUpdate, IllegalTransition) as e:
            log.info("job %s: changed while ingesting (%s); again next tick", job_id, e)

    def _ingest(self, a: Attached, snap: Mapping[str, Any]) -> None:
        """Write one controller snapshot into the store (one transaction), then act on it."""
        new_events = [e for e in snap["events"] if e["seq"] > a.seq]
        a.seq, current = write_snapshot(self._sf, a.job_id, a.seq, snap, new_events,
                                        feedback=self.settings.planner_feedback)
        a.controller_state = ControllerState(snap["state"])
        if a.controller_state in PLACED_STATES:
            a.placement = list(snap["placement"])
        a.metrics.observe(snap, new_events)
        if snap["terminal"]:
            self._detach(a.job_id, f"controller {snap['state']}")
        elif current.terminal and not a.cancel_sent:
            self._send_cancel(a, f"job {current.value} in the store")

    def _send_cancels(self) -> None:
        with self._lock:
            wanted, self._cancels = self._cancels, set()
        for job_id in wanted:
            a = self._attached.get(job_id)
            if a is not None and not a.cancel_sent:
                self._send_cancel(a, "cancelled through the API")

    def _send_cancel(self, a: Attached, reason: str) -> None:
        try:
            a.controller.cancel(reason)  # the next polls see CANCELLED; then it is detached
            a.cancel_sent = True
        except ControllerGone:
            self._detach(a.job_id, "controller gone while cancelling")

    def _detach(self, job_id: str, why: str) -> None:
        self._attached.pop(job_id, None)
        self._waiting.forget(job_id)
        self._preemptor.forget(job_id)
        kill_controller(job_id)
        metrics.forget_job(job_id)
        log.info("job %s: detached (%s)", job_id, why)
        self._wake.set()  # its GPUs may let a queued job start

    # ---- the cluster -----------------------------------------------------------------------------------
    def _refresh_cluster(self) -> Topology:
        live = live_topology()
        with self._rsf() as s:
            changes = sync_nodes(s, live, dry_run=True)
        if changes:
            with store.session_scope(self._sf) as s:
                sync_nodes(s, live)
        with self._rsf() as s:
            ledger = read_ledger(s)
        topology = live.with_health(ledger.health, ledger.cordoned)
        self._topology, self._ledger = topology, ledger
        if ledger != self._ledger_pushed:
            for a in list(self._attached.values()):
                try:
                    a.controller.update_nodes(ledger.health, ledger.cordoned)
                except ControllerGone:
                    log.debug("job %s: controller gone; its next poll recovers it", a.job_id)
            self._ledger_pushed = ledger
        observe_cluster(topology)
        return topology

    # ---- starting queued jobs ----------------------------------------------------------------------------
    def _schedule(self, topology: Topology) -> None:
        if any(a.reserving for a in self._attached.values()):
            return  # one reservation in flight at a time
        view = free_view(topology, held_gpus(self._attached.values()))
        free = sum(n.gpus_free for n in view.schedulable_nodes())
        with self._rsf() as s:  # quotas, weighted fair share, backfill (service/scheduler/fairshare.py)
            queued = admission.queue_decisions(s, free_gpus=free, now=time.time(), skip=set(self._attached))
        for q in queued:
            if q.layout is None or q.decision is None:
                admission.fail_job(self._sf, q.job_id, q.error or "the job's plan has no usable layout")
                continue
            if not q.decision.start and q.decision.kind in admission.OWN_REASONS:
                self._waiting.note(q.job_id, q.decision.reason)
                continue
            if (held := self._preemptor.held_back(q.job_id)) is not None:
                self._waiting.note(q.job_id, held)
                continue
            try:
                intended = place(q.layout, view)
            except PlacementError as e:  # lent GPUs or lower-priority jobs may make room (scheduler.notices)
                room = self._preemptor.make_room(
                    q.job_id, q.layout, topology, self._attached,
                    for_priority=self.settings.preempt_for_priority,
                    reclaim=self.settings.reclaim_borrowed and not q.decision.borrowing)
                self._waiting.note(q.job_id, room or admission.waiting_reason(q.layout, view, e))
                continue
            if not q.decision.start:  # the GPUs are there but fair share or a reservation says wait
                self._waiting.note(q.job_id, q.decision.reason)
                continue
            self._start(q.job_id, q.version, q.layout, intended, borrowing=q.decision.borrowing)
            return  # the next start waits until this one holds its GPUs

    def _start(self, job_id: str, version: int, layout: Layout, intended: Placement, *,
               borrowing: bool = False) -> None:
        nodes: dict[str, int] = {}
        for r in intended.ranks:
            nodes[r.node_name] = nodes.get(r.node_name, 0) + 1
        try:
            with store.session_scope(self._sf) as s:
                lent = " (borrowed beyond its tenant's quota, reclaimable)" if borrowing else ""
                job = store.transition(
                    s, job_id, JobState.STARTING, expected_version=version,
                    reason=f"{layout.world_size} GPUs free for {layout.describe()}{lent}",
                    event_payload={"nodes": nodes, "notes": list(intended.notes), "borrowing": borrowing},
                )
                doc = dict(job.progress or {})
                if borrowing or doc.get("borrowing"):  # its GPUs are lent, reclaimable
                    store.update_progress(s, job_id, progress={**doc, "borrowing": borrowing})
                spec_row, seq, created = dict(job.spec), job.controller_seq, job.created_at
                reached = job.step  # 0, or the checkpoint a resumed job restores (faults before it are done)
                note_resumed(s, job_id, reached)
        except (ConcurrentUpdate, IllegalTransition) as e:
            log.info("job %s changed before it could start: %s", job_id, e)
            return
        self._waiting.forget(job_id)
        metrics.QUEUE_WAIT.observe(max(0.0, time.time() - created.timestamp()))
        self._launch(job_id, JobSpec.model_validate(spec_row), seq, nodes, reached_step=reached,
                     restarts_used=0)

    def _launch(self, job_id: str, spec: JobSpec, seq: int, intended: Mapping[str, int], *,
                reached_step: int, restarts_used: int) -> None:
        """Create the job's controller (or attach to the one already there)."""
        with self._rsf() as s:
            job = store.get_job(s, job_id)
            layout = Layout.from_dict((job.plan or {})["layout"])
            ledger = read_ledger(s)
        ckpt_dir = (self.settings.checkpoint_root / job_id).resolve()  # type: ignore[operator]
        policy = RestartPolicy(max_restarts=max(0, spec.fault_tolerance.max_restarts - restarts_used))
        try:
            period = default_checkpoint_period(spec, job.plan or {}, self.settings)
            run_cfg = spec.to_run_config(layout, str(ckpt_dir),
                                         precision=((job.plan or {}).get("train") or {}).get("precision"),
                                         every_steps=period["every_steps"] if period else None,
                                         data_root=os.path.realpath(self.settings.data_root_path))
            options = admission.controller_options(self.settings, spec, seq, reached_step,
                                                   self._controller_defaults)
            controller = start_controller(job_id, run_cfg, options=options, failure_policy=policy,
                                          scaling_policy=admission.scaling_policy(spec, job.plan),
                                          health=dict(ledger.health), cordoned=sorted(ledger.cordoned))
        except ControllerExists:
            found = find_controller(job_id)
            if found is None:
                return  # it just ended; the next tick sees the job again
            controller = found
            log.info("job %s: its controller already exists; attaching", job_id)
        except Exception as e:  # a job that cannot get a controller fails, saying why; logged
            log.exception("job %s: cannot start its controller", job_id)
            cause = e.__cause__ if isinstance(e, ControllerStartError) and e.__cause__ else e
            reason = f"could not start the job's controller: {type(cause).__name__}: {cause}"
            admission.fail_job(self._sf, job_id, reason[:1000])
            return
        self._attach(job_id, controller, seq, intended, observe_launch(job_id, job.plan))
