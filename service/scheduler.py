"""The scheduler and reconciler: the service's one writer of job progress and cluster state.

One thread runs `tick()` every `settings.scheduler_interval_s` (sooner when the API calls
`wake()`). A tick:

1. polls every attached job controller (`poll(since_seq)`) and writes what it reports into the
   store in one short transaction per job: the controller's events (append-only, in order, each
   once: the job row keeps the last controller seq stored), progress, the placement read back
   from the rank actors, checkpoint rows, node faults, and the job's state, moved only through
   `store.transition` along legal edges; a terminal controller is collected and ended;
2. syncs the nodes table with the live Ray cluster (new nodes upserted, missing ones dead) and
   reads the health ledger (suspect, quarantined, cordoned) back for placement;
3. admits pending jobs (re-planning those planned for another GPU type than the live cluster's);
4. starts queued jobs in priority order, then age, when `workers.placement.place` fits their
   layout on the free capacity; a job that does not fit stays queued with the reason as an
   event (once per distinct reason).

Cancel is the API's `transition(... cancelled)` followed by `cancel(job_id)`: the next tick asks
the controller to tear down its ranks and placement group, and the freed GPUs go to the next
queued job. `start()` reconciles first: an active job whose detached controller is alive is
re-attached (polling resumes after the last stored seq); one whose controller is gone is
recovered by a new controller that resumes from the job's last checkpoint (an event says so).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service import metrics, store
from service.errors import ConcurrentUpdate, IllegalTransition, JobNotFound
from service.fault_metrics import observe_fault_events
from service.scheduler_sync import (
    ATTEMPT_EVENTS,
    ClusterLedger,
    job_transition_path,
    read_ledger,
    replan_if_needed,
    store_controller_event,
    summarize_result,
    sync_nodes,
)
from service.schemas import JobSpec
from service.settings import Settings
from service.store.models import ACTIVE_STATES, Job, JobEvent, JobState
from training.config.layout import Layout
from workers.controller import (
    NAMESPACE,
    ControllerExists,
    ControllerOptions,
    controller_name,
    get_controller,
    start_controller,
)
from workers.placement import Placement, PlacementError, place
from workers.policies import RestartPolicy
from workers.topology import Topology

log = logging.getLogger(__name__)

# A job whose controller keeps vanishing (it cannot even start) is failed after this many recoveries.
MAX_CONTROLLER_RECOVERIES = 10
# A controller whose poll() raises this many times in a row is replaced (the job recovers).
MAX_POLL_ERRORS = 30
# Controller states in which a job has not yet reserved its GPUs: while one exists, no other job is
# started, so that two controllers never race for the same free GPUs.
_UNPLACED = {"INIT", "PLACING"}


@dataclasses.dataclass
class Attached:
    """A job whose controller this scheduler polls."""

    job_id: str
    handle: Any
    seq: int  # last controller event seq stored
    intended: dict[str, int]  # node name -> GPUs the scheduler planned for it (until the actual is known)
    controller_state: str = "INIT"
    placement: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    step: int = 0
    cancel_sent: bool = False
    failure_cause: str = "unknown"
    poll_errors: int = 0
    # Model FLOPs per step over the cluster's peak FLOP/s (from the job's plan): measured MFU is
    # this over the step time, also where the ranks cannot name their device's peak (virtual GPUs).
    mfu_seconds: float | None = None

    def gpus_by_node(self) -> dict[str, int]:
        if self.controller_state == "WAITING":
            return {}
        if self.placement:
            out: dict[str, int] = {}
            for r in self.placement:
                out[r["node_name"]] = out.get(r["node_name"], 0) + 1
            return out
        return dict(self.intended)


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
    ) -> None:
        self.settings = settings
        self._sf = session_factory
        self._rsf = read_session_factory or session_factory
        # Extra ControllerOptions fields for every job (e.g. train_fn in tests, poll_interval_s).
        self._controller_defaults = {"poll_interval_s": 0.2, **dict(controller_defaults or {})}
        self.interval_s = interval_s if interval_s is not None else settings.scheduler_interval_s
        self.poll_timeout_s = poll_timeout_s
        self._attached: dict[str, Attached] = {}
        self._cancels: set[str] = set()
        self._waiting_reason: dict[str, str] = {}
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

    def inject_fault(self, job_id: str, fault: Mapping[str, Any]) -> bool:
        """Hand a fault spec (workers.faults) to the job's controller; False if the job has none here.
        The caller checks settings.fault_injection and the admin role."""
        a = self._attached.get(job_id)
        if a is None:
            return False
        ray.get(a.handle.inject_fault.remote(**dict(fault)), timeout=self.poll_timeout_s)
        return True

    def cluster_view(self) -> tuple[Topology | None, ClusterLedger | None]:
        """The live topology (health merged) and the ledger as of the last tick."""
        return self._topology, self._ledger

    def attached_jobs(self) -> list[str]:
        return sorted(self._attached)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Reconcile with the cluster, then run the loop in a daemon thread."""
        self.reconcile()
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

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive a bad tick (DB or Ray hiccup)
                log.exception("scheduler tick failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def tick(self) -> None:
        self._send_cancels()
        for job_id in list(self._attached):
            try:
                self._poll(job_id)
            except Exception:  # noqa: BLE001 - one job's trouble must not stall the others
                log.exception("job %s: poll/ingest failed", job_id)
        topology = self._refresh_cluster()
        self._admit_pending(topology)
        self._schedule(topology)
        self._queue_metrics()

    # ---- reconcile ---------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Re-attach live controllers of unfinished jobs; recover active jobs whose controller is gone;
        end controllers of jobs the store says are finished."""
        states = [JobState.QUEUED, *ACTIVE_STATES]
        with self._rsf() as s:
            jobs = [(j.id, JobState(j.state), j.controller_seq) for j in store.list_jobs(
                s, states=states, limit=None, order="queue")]
        for job_id, state, seq in jobs:
            handle = get_controller(job_id)
            if handle is not None and self._responds(handle, seq):
                self._attach(job_id, handle, seq, {})
                with store.session_scope(self._sf) as s:
                    store.append_event(s, job_id, "reattached", {"controller": controller_name(job_id),
                                                                  "after_seq": seq})
                log.info("job %s: re-attached to its controller after seq %d", job_id, seq)
            elif state in ACTIVE_STATES:
                self._recover(job_id, "its controller is gone (found when the service started)")
        self._end_orphans()

    def _responds(self, handle: Any, seq: int) -> bool:
        try:
            ray.get(handle.poll.remote(seq), timeout=self.poll_timeout_s)
            return True
        except (RayActorError, ActorUnavailableError, GetTimeoutError) as e:
            log.warning("controller did not answer: %s", e)
            return False

    def _end_orphans(self) -> None:
        """A controller of a job that the store says is finished (the service died between the
        commit and ending it, or before a cancel reached it) must not keep running."""
        prefix = controller_name("")
        try:
            actors = ray.util.list_named_actors(all_namespaces=True)
        except Exception as e:  # noqa: BLE001 - best effort
            log.warning("cannot list named actors: %s", e)
            return
        for entry in actors:
            if entry.get("namespace") != NAMESPACE or not entry.get("name", "").startswith(prefix):
                continue
            job_id = entry["name"][len(prefix):]
            with self._rsf() as s:
                job = s.get(Job, job_id)
                terminal = job is not None and JobState(job.state).terminal
            if terminal:
                log.info("job %s is finished in the store; ending its leftover controller", job_id)
                self._kill(job_id)

    # ---- polling attached controllers ------------------------------------------------------------------
    def _attach(self, job_id: str, handle: Any, seq: int, intended: Mapping[str, int]) -> Attached:
        a = Attached(job_id=job_id, handle=handle, seq=seq, intended=dict(intended))
        self._attached[job_id] = a
        return a

    def _poll(self, job_id: str) -> None:
        a = self._attached[job_id]
        try:
            snap = ray.get(a.handle.poll.remote(a.seq), timeout=self.poll_timeout_s)
        except GetTimeoutError:
            log.warning("job %s: controller poll timed out; retrying next tick", job_id)
            return
        except ActorUnavailableError as e:
            log.warning("job %s: controller unavailable (%s); retrying next tick", job_id, e)
            return
        except RayActorError as e:
            del self._attached[job_id]
            self._recover(job_id, f"its controller died: {type(e).__name__}: {str(e)[:300]}")
            return
        except RayError as e:  # poll() itself raised: a controller bug; do not let it stall the others
            a.poll_errors += 1
            log.error("job %s: controller poll failed (%d in a row): %s", job_id, a.poll_errors, e)
            if a.poll_errors >= MAX_POLL_ERRORS:
                del self._attached[job_id]
                self._kill(job_id)
                self._recover(job_id, f"its controller failed {a.poll_errors} polls in a row: {e}"[:500])
            return
        a.poll_errors = 0
        try:
            self._ingest(a, snap)
        except (ConcurrentUpdate, IllegalTransition) as e:
            log.info("job %s: changed while ingesting (%s); again next tick", job_id, e)

    def _ingest(self, a: Attached, snap: Mapping[str, Any]) -> None:
        """Write one controller snapshot into the store (one transaction), then act on it."""
        job_id = a.job_id
        new_events = [e for e in snap["events"] if e["seq"] > a.seq]
        progress = snap["progress"]
        with store.session_scope(self._sf) as s:
            job = store.get_job(s, job_id)
            s.refresh(job)
            floor = max(a.seq, job.controller_seq)
            for event in new_events:
                if event["seq"] > floor:
                    store_controller_event(s, job, event)
            last_seq = max([floor, *(e["seq"] for e in new_events)])
            current = JobState(job.state)
            if not current.terminal:
                fields: dict[str, Any] = {"controller_seq": last_seq}
                for key in ("loss", "tokens_per_s", "mfu"):
                    if progress.get(key) is not None:
                        fields[key] = progress[key]
                if progress.get("step") is not None:
                    fields["step"] = int(progress["step"])
                if snap["state"] in ("RUNNING", "CHECKPOINTING") or snap["terminal"]:
                    if snap["placement"] and snap["placement"] != job.placement:
                        fields["placement"] = snap["placement"]
                store.update_progress(s, job_id, **fields)
                self._mirror_state(s, job, snap)
        a.seq = last_seq
        a.controller_state = snap["state"]
        if snap["state"] in ("RUNNING", "CHECKPOINTING"):
            a.placement = list(snap["placement"])
        self._job_metrics(a, snap, new_events)
        if snap["terminal"]:
            self._detach(job_id, f"controller {snap['state']}")
        elif current.terminal and not a.cancel_sent:
            self._send_cancel(a, f"job {current.value} in the store")

    def _mirror_state(self, s: Session, job: Job, snap: Mapping[str, Any]) -> None:
        target = JobState(snap["job_state"])
        path = job_transition_path(JobState(job.state), target)
        for step_state in path:
            fields: dict[str, Any] = {"attempt": self._attempts(s, job.id)}
            reason = f"controller {snap['state']}"
            if step_state == JobState.SUCCEEDED:
                fields["result"] = summarize_result(snap.get("result") or {}, snap["progress"])
                reason = "all ranks finished"
            elif step_state == JobState.FAILED:
                reason = snap.get("reason") or "the controller failed the job"
            elif step_state == JobState.QUEUED and snap.get("reason"):
                reason = f"waiting for capacity: {snap['reason']}"
            store.transition(s, job.id, step_state, reason=reason, set_fields=fields)

    @staticmethod
    def _count_events(s: Session, job_id: str, types: tuple[str, ...]) -> int:
        return int(s.scalar(select(func.count()).select_from(JobEvent).where(
            JobEvent.job_id == job_id, JobEvent.type.in_(types))) or 0)

    @classmethod
    def _attempts(cls, s: Session, job_id: str) -> int:
        """Restarts so far: the controllers' restarts plus the recoveries of lost controllers."""
        return cls._count_events(s, job_id, ATTEMPT_EVENTS)

    def _job_metrics(self, a: Attached, snap: Mapping[str, Any], events: list[dict[str, Any]]) -> None:
        p, job_id = snap["progress"], a.job_id
        step = p.get("step") or 0
        metrics.JOB_STEP.labels(job_id).set(step)
        for gauge, key in ((metrics.JOB_LOSS, "loss"), (metrics.JOB_TOKENS_PER_S, "tokens_per_s"),
                           (metrics.JOB_MFU, "mfu")):
            if isinstance(p.get(key), int | float):
                gauge.labels(job_id).set(p[key])
        step_time = p.get("step_time_s")
        if not isinstance(p.get("mfu"), int | float) and a.mfu_seconds and isinstance(step_time, int | float):
            if step_time > 0:
                metrics.JOB_MFU.labels(job_id).set(a.mfu_seconds / step_time)
        if step > a.step and isinstance(p.get("step_time_s"), int | float):
            metrics.JOB_STEP_TIME.labels(job_id).observe(p["step_time_s"])
        a.step = step
        for e in events:
            if e["kind"] == "checkpoint_saved":
                if isinstance(e.get("seconds"), int | float):
                    metrics.JOB_CHECKPOINT_SECONDS.labels(job_id).set(e["seconds"])
                if isinstance(e.get("bytes"), int | float):
                    metrics.JOB_CHECKPOINT_BYTES.labels(job_id).set(e["bytes"])
            elif e["kind"] == "failure":
                a.failure_cause = str((e.get("failure") or {}).get("kind", "unknown"))
            elif e["kind"] == "restart":
                metrics.JOB_RESTARTS.labels(job_id, a.failure_cause).inc()
                metrics.RESTARTS_BY_CAUSE.labels(a.failure_cause).inc()
            elif e["kind"] == "integrity_error":
                metrics.JOB_SDC.labels(job_id).inc()
                metrics.SDC_DETECTIONS.inc()
        # time to detect / to recover, steps lost, goodput (issue 6)
        observe_fault_events(job_id, events, snap)

    def _send_cancels(self) -> None:
        with self._lock:
            wanted, self._cancels = self._cancels, set()
        for job_id in wanted:
            a = self._attached.get(job_id)
            if a is not None and not a.cancel_sent:
                self._send_cancel(a, "cancelled through the API")

    def _send_cancel(self, a: Attached, reason: str) -> None:
        try:
            a.handle.cancel.remote(reason)  # the next polls see CANCELLED; then it is detached
            a.cancel_sent = True
        except RayActorError:
            self._detach(a.job_id, "controller gone while cancelling")

    def _detach(self, job_id: str, why: str) -> None:
        self._attached.pop(job_id, None)
        self._waiting_reason.pop(job_id, None)
        self._kill(job_id)
        metrics.forget_job(job_id)
        log.info("job %s: detached (%s)", job_id, why)
        self._wake.set()  # its GPUs may let a queued job start

    @staticmethod
    def _kill(job_id: str) -> None:
        handle = get_controller(job_id)
        if handle is not None:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("kill controller %s: %s", job_id, e)

    # ---- recovery of a lost controller -------------------------------------------------------------------
    def _recover(self, job_id: str, why: str) -> None:
        """Start a new controller that resumes from the job's last checkpoint (never run twice: the
        named controller is unique, and the old one, with its ranks, is gone)."""
        with store.session_scope(self._sf) as s:
            job = store.get_job(s, job_id)
            s.refresh(job)
            if JobState(job.state).terminal:
                return
            if JobState(job.state) in (JobState.PENDING, JobState.QUEUED):
                # It held no GPUs (its controller was waiting for capacity): the queue starts it again.
                store.append_event(s, job_id, "controller_lost", {"reason": why})
                return
            recoveries = self._count_events(s, job_id, ("recover",))
            if recoveries >= MAX_CONTROLLER_RECOVERIES:
                store.transition(s, job_id, JobState.FAILED,
                                 reason=f"controller lost {recoveries} times; last: {why}")
                return
            ckpt = store.latest_checkpoint(s, job_id, verified_only=False)
            step = ckpt.step if ckpt is not None else None
            resume = f"its last checkpoint (step {step})" if step is not None else "step 0 (no checkpoint)"
            store.append_event(s, job_id, "recover", {
                "reason": why, "checkpoint_step": step, "attempt": self._attempts(s, job_id) + 1,
                "message": f"{why}: a new controller resumes from {resume}",
            })
            if JobState(job.state) != JobState.RECOVERING:
                store.transition(s, job_id, JobState.RECOVERING, reason=why,
                                 set_fields={"attempt": self._attempts(s, job_id)})
            spec_row, seq, reached = dict(job.spec), job.controller_seq, job.step
            # Service restarts do not spend the job's fault budget; its controllers' restarts do.
            restarts = self._count_events(s, job_id, ("restart",))
        log.warning("job %s: %s; recovering from %s", job_id, why, resume)
        self._launch(job_id, JobSpec.model_validate(spec_row), seq, {}, reached_step=reached,
                     restarts_used=restarts)

    # ---- the cluster -----------------------------------------------------------------------------------
    def _refresh_cluster(self) -> Topology:
        live = Topology.from_ray()
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
                    a.handle.update_nodes.remote(dict(ledger.health), sorted(ledger.cordoned))
                except RayActorError:
                    pass
            self._ledger_pushed = ledger
        self._cluster_metrics(topology, ledger)
        return topology

    @staticmethod
    def _cluster_metrics(topology: Topology, ledger: ClusterLedger) -> None:
        states = ("ready", "suspect", "quarantined", "cordoned", "dead")
        for n in topology.gpu_nodes:
            metrics.GPUS_TOTAL.labels(n.name, n.rack).set(n.gpus_total)
            metrics.GPUS_FREE.labels(n.name, n.rack).set(n.gpus_free if n.alive else 0)
            shown = "cordoned" if n.cordoned and n.health in ("ready", "suspect") else n.health
            for state in states:
                metrics.NODE_HEALTH.labels(n.name, n.rack, state).set(1 if state == shown else 0)
        metrics.NODES_QUARANTINED.set(sum(1 for n in topology.gpu_nodes if n.health == "quarantined"))

    def _free_view(self, topology: Topology) -> Topology:
        """The live topology with each node's free GPUs lowered by what attached jobs hold or are
        about to reserve (Ray's free counts lag a placement group that is not created yet)."""
        held: dict[str, int] = {}
        for a in self._attached.values():
            for node, n in a.gpus_by_node().items():
                held[node] = held.get(node, 0) + n
        nodes = tuple(
            dataclasses.replace(n, gpus_free=max(0, min(n.gpus_free, n.gpus_total - held.get(n.name, 0))))
            for n in topology.nodes
        )
        return dataclasses.replace(topology, nodes=nodes)

    # ---- admission and scheduling ------------------------------------------------------------------------
    def _admit_pending(self, topology: Topology) -> None:
        with self._rsf() as s:
            pending = [j.id for j in store.list_jobs(s, states=[JobState.PENDING], limit=None, order="queue")]
        for job_id in pending:
            try:
                with store.session_scope(self._sf) as s:
                    job = store.get_job(s, job_id)
                    s.refresh(job)
                    if JobState(job.state) != JobState.PENDING:
                        continue
                    error = replan_if_needed(s, job, self.settings, topology)
                    if error is not None:
                        store.transition(s, job_id, JobState.FAILED, reason=error)
                    else:
                        store.transition(s, job_id, JobState.QUEUED, reason="admitted to the queue",
                                         expected_version=job.version)
            except (ConcurrentUpdate, IllegalTransition, JobNotFound) as e:
                log.info("job %s changed while being admitted: %s", job_id, e)

    def _schedule(self, topology: Topology) -> None:
        if any(a.controller_state in _UNPLACED for a in self._attached.values()):
            return  # one reservation in flight at a time
        view = self._free_view(topology)
        with self._rsf() as s:
            queued = [(j.id, dict(j.plan or {}), j.version) for j in store.list_jobs(
                s, states=[JobState.QUEUED], limit=None, order="queue") if j.id not in self._attached]
        for job_id, plan, version in queued:
            try:
                layout = Layout.from_dict(plan["layout"])
            except (KeyError, TypeError, ValueError) as e:
                self._fail(job_id, f"the job's plan has no usable layout: {e}")
                continue
            try:
                intended = place(layout, view)
            except PlacementError as e:
                self._note_waiting(job_id, str(e))
                continue
            self._start(job_id, version, layout, intended)
            return  # the next start waits until this one holds its GPUs

    def _note_waiting(self, job_id: str, reason: str) -> None:
        if job_id not in self._waiting_reason:
            with self._rsf() as s:
                last = store.list_events(s, job_id, limit=None, types=["waiting"])
            if last:
                self._waiting_reason[job_id] = str(last[-1].payload.get("reason"))
        if self._waiting_reason.get(job_id) == reason:
            return
        self._waiting_reason[job_id] = reason
        with store.session_scope(self._sf) as s:
            store.append_event(s, job_id, "waiting", {"reason": reason})
        log.info("job %s waits: %s", job_id, reason)

    def _fail(self, job_id: str, reason: str) -> None:
        try:
            with store.session_scope(self._sf) as s:
                store.transition(s, job_id, JobState.FAILED, reason=reason)
        except (ConcurrentUpdate, IllegalTransition) as e:
            log.info("job %s: not failed (%s)", job_id, e)

    def _start(self, job_id: str, version: int, layout: Layout, intended: Placement) -> None:
        nodes: dict[str, int] = {}
        for r in intended.ranks:
            nodes[r.node_name] = nodes.get(r.node_name, 0) + 1
        try:
            with store.session_scope(self._sf) as s:
                job = store.transition(
                    s, job_id, JobState.STARTING, expected_version=version,
                    reason=f"{layout.world_size} GPUs free for {layout.describe()}",
                    event_payload={"nodes": nodes, "notes": list(intended.notes)},
                )
                spec_row, seq, created = dict(job.spec), job.controller_seq, job.created_at
        except (ConcurrentUpdate, IllegalTransition) as e:
            log.info("job %s changed before it could start: %s", job_id, e)
            return
        self._waiting_reason.pop(job_id, None)
        metrics.QUEUE_WAIT.observe(max(0.0, time.time() - created.timestamp()))
        self._launch(job_id, JobSpec.model_validate(spec_row), seq, nodes, reached_step=0, restarts_used=0)

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
            run_cfg = spec.to_run_config(layout, str(ckpt_dir))
            options = self._controller_options(spec, seq, reached_step)
            handle = start_controller(job_id, run_cfg, options=options, failure_policy=policy,
                                      health=dict(ledger.health), cordoned=sorted(ledger.cordoned))
        except ControllerExists:
            handle = get_controller(job_id)
            if handle is None:
                return  # it just ended; the next tick sees the job again
            log.info("job %s: its controller already exists; attaching", job_id)
        except Exception as e:  # noqa: BLE001 - a job that cannot get a controller must say why
            log.exception("job %s: cannot start its controller", job_id)
            self._fail(job_id, f"could not start the job's controller: {type(e).__name__}: {e}"[:1000])
            return
        predicted = ((job.plan or {}).get("predicted") or {}).get("mfu")
        if isinstance(predicted, int | float):
            metrics.JOB_MFU_PREDICTED.labels(job_id).set(predicted)
        self._attach(job_id, handle, seq, intended).mfu_seconds = _mfu_seconds(job.plan)

    def _controller_options(self, spec: JobSpec, seq: int, reached_step: int) -> ControllerOptions:
        from service.planner import flops_per_token

        model = spec.model_spec()
        faults: tuple[dict[str, Any], ...] = ()
        if self.settings.fault_injection:  # the controller validates and carries them out (issue 6)
            faults = tuple(f.model_dump(exclude_none=True) for f in spec.faults if f.at_step > reached_step)
        fields: dict[str, Any] = {
            "hang_timeout_s": spec.fault_tolerance.heartbeat_timeout_s or self.settings.heartbeat_timeout_s,
            "first_seq": seq,
            "faults": faults,
            "flops_per_token": flops_per_token(model, model.seq_len),
            **self._controller_defaults,
        }
        fields["first_seq"] = seq  # events continue the job's numbering whatever the defaults say
        return ControllerOptions(**fields)

    def _queue_metrics(self) -> None:
        with self._rsf() as s:
            counts = store.count_jobs_by_state(s)
        for state, n in counts.items():
            metrics.JOBS_BY_STATE.labels(state.value).set(n)
        metrics.QUEUE_DEPTH.set(counts[JobState.PENDING] + counts[JobState.QUEUED])


def _mfu_seconds(plan: Mapping[str, Any] | None) -> float | None:
    """flops_per_step / (GPUs x peak FLOP/s) of the planned cluster: MFU x step time."""
    from service.planner import GPU_CATALOG

    plan = plan or {}
    cluster = plan.get("cluster") or {}
    gpu = GPU_CATALOG.get(str(cluster.get("gpu_type")))
    flops, gpus = plan.get("flops_per_step"), cluster.get("num_gpus")
    if gpu is None or not isinstance(flops, int | float) or not isinstance(gpus, int) or gpus < 1:
        return None
    return float(flops) / (gpus * gpu.peak_flops)
