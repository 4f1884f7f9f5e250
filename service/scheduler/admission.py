"""Admission: pending jobs enter the queue (re-planned for the live cluster's GPU type when their
plan was made for another, and with its measured hardware profile when made from the catalogue), the
order queued jobs start in (`queue_decisions`: quotas, weighted fair share and backfill, decided by the
pure `fairshare.decide` from the store's numbers), and what a queued job's controller is started with."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.checkpoint_period import shown_with_plan
from service.errors import ConcurrentUpdate, IllegalTransition, JobNotFound
from service.planner import (
    ClusterSpec,
    Plan,
    PlannerError,
    TrainSpec,
    default_precision,
    flops_per_token,
    get_gpu,
    layout_gpus,
    plan_layout,
)
from service.planner.efficiency import HardwareProfile
from service.planner.specs import CPU_GPU_TYPES
from service.scheduler import fairshare
from service.schemas import JobSpec
from service.settings import Settings
from service.store import tenants as tenant_store
from service.store.models import ACTIVE_STATES, Job, JobState
from service.store.profiles import profile_for
from training.config.layout import Layout
from workers.client import ControllerOptions
from workers.controller.elastic import elastic_policy
from workers.policies import ScalingPolicy
from workers.topology import Topology

log = logging.getLogger(__name__)


def admit_pending(sf: sessionmaker[Session], rsf: sessionmaker[Session], settings: Settings,
                  topology: Topology, *, hold: str | None = None, notes: WaitingNotes | None = None) -> None:
    """Move every pending job to the queue, or fail it when no plan fits the live cluster; with `hold`
    (why plans should wait: the cluster's first hardware profile is being measured) leave them pending,
    saying why in `notes`. A plan made from the catalogue is re-planned once a measured profile exists.

    Planning runs between two transactions, never inside one: a large search takes seconds of CPU,
    and on SQLite a write transaction holds the database's only write lock. The write that follows
    is a compare-and-set on the version read before planning, so a job changed meanwhile is left
    for the next tick."""
    with rsf() as s:
        pending = [(j.id, j.version, j.spec, j.plan)
                   for j in store.list_jobs(s, states=[JobState.PENDING], limit=None, order="queue")]
        profile = profile_for(s, settings.gpu_type) if pending and hold is None else None
    if hold is not None:
        for job_id, *_ in pending:
            if notes is not None:
                notes.note(job_id, hold, state=JobState.PENDING)
        return
    for job_id, version, spec, plan in pending:
        replanned, error = plan_for_live_cluster(spec, plan, settings, topology, profile=profile)
        try:
            with store.session_scope(sf) as s:
                if error is not None:
                    store.transition(s, job_id, JobState.FAILED, reason=error, expected_version=version)
                    continue
                store.transition(s, job_id, JobState.QUEUED, reason="admitted to the queue",
                                 expected_version=version)
                if replanned is not None:
                    doc = shown_with_plan(JobSpec.model_validate(spec), replanned.to_dict(), settings)
                    store.set_plan(s, job_id, doc, reason=replanned_reason(plan, settings, profile))
        except (ConcurrentUpdate, IllegalTransition, JobNotFound) as e:
            log.info("job %s changed while being admitted: %s", job_id, e)


# Waiting decisions whose reason is fair share's own; for the others (no room) placement says why.
OWN_REASONS = frozenset({fairshare.QUOTA})


@dataclasses.dataclass(frozen=True)
class QueuedJob:
    """A queued job as the scheduler starts it: its layout (None with the reason it has none) and
    the fair-share decision about it."""

    job_id: str
    version: int
    layout: Layout | None
    decision: fairshare.Decision | None
    error: str | None = None


def _layout(plan: Mapping[str, Any] | None) -> tuple[Layout | None, str | None]:
    try:
        return Layout.from_dict((plan or {})["layout"]), None
    except (KeyError, TypeError, ValueError) as e:
        return None, f"the job's plan has no usable layout: {e}"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _running(job: Job, layout: Layout, now: float) -> fairshare.RunningJob:
    progress = job.progress or {}
    eta = _number(progress.get("eta_s"))  # remaining steps x median step time (service.progress)
    return fairshare.RunningJob(job.id, job.tenant, layout.world_size, None if eta is None else now + eta,
                                borrowing=bool(progress.get("borrowing")))


def _waiting(job: Job, layout: Layout) -> fairshare.WaitingJob:
    step_time = _number(((job.plan or {}).get("predicted") or {}).get("step_time_s"))
    steps = _number(((job.spec or {}).get("train") or {}).get("steps"))
    duration = None if step_time is None or steps is None else max(0.0, steps - job.step) * step_time
    return fairshare.WaitingJob(job.id, job.tenant, layout.world_size, job.priority,
                                job.created_at.timestamp(), duration)


def tenant_policies(s: Session) -> dict[str, fairshare.TenantPolicy]:
    return {t.name: fairshare.TenantPolicy(t.name, weight=float(t.weight if t.weight is not None else 1.0),
                                           gpu_quota=t.gpu_quota, borrowing=bool(t.borrowing))
            for t in tenant_store.list_tenants(s)}


def queue_decisions(s: Session, *, free_gpus: int, now: float, skip: Collection[str] = ()) -> list[QueuedJob]:
    """The queued jobs (but `skip`) with their fair-share decisions: those without a usable layout
    (no decision: they cannot run), those waiting for a reason of fair share's own (quota), those
    to start in the order to start them, then the rest. Running jobs hold their layout's GPUs and
    end at their progress ETA."""
    running = []
    for job in store.list_jobs(s, states=ACTIVE_STATES, limit=None):
        layout, _ = _layout(job.plan)
        if layout is not None:
            running.append(_running(job, layout, now))
    broken: list[QueuedJob] = []
    queued: dict[str, tuple[Job, Layout]] = {}
    for job in store.list_jobs(s, states=[JobState.QUEUED], limit=None, order="queue"):
        if job.id in skip:
            continue
        layout, error = _layout(job.plan)
        if layout is None:
            broken.append(QueuedJob(job.id, job.version, None, None, error))
        else:
            queued[job.id] = (job, layout)
    waiting = [_waiting(job, layout) for job, layout in queued.values()]
    decisions = fairshare.decide(waiting, running, tenant_policies(s), free_gpus=free_gpus, now=now)
    # Waits that fair share explains come first: the caller notes them before it starts a job.
    decisions.sort(key=lambda d: d.start or d.kind not in OWN_REASONS)
    return broken + [QueuedJob(d.job_id, queued[d.job_id][0].version, queued[d.job_id][1], d)
                     for d in decisions]


def warm_standby(settings: Settings) -> bool:
    """Whether jobs keep warm processes on their standby nodes too (settings.warm_standby). auto: not on
    a CPU node type, whose ranks compute on the host's cores: there a standby process's imports are
    taken from the running job's ranks, to speed up a node loss's recovery by seconds."""
    if settings.warm_standby != "auto":
        return settings.warm_standby == "on"
    return _canonical_gpu(settings.gpu_type) not in CPU_GPU_TYPES


def _canonical_gpu(name: str | None) -> str | None:
    if not name:
        return None
    try:
        return get_gpu(name).name
    except PlannerError:
        return name


def replanned_reason(plan: Mapping[str, Any] | None, settings: Settings,
                     profile: HardwareProfile | None = None) -> str:
    planned = _canonical_gpu(((plan or {}).get("cluster") or {}).get("gpu_type"))
    live = _canonical_gpu(settings.gpu_type)
    if (plan or {}).get("layout") and planned == live and profile is not None:
        return f"re-planned with the {live} nodes' measured hardware profile v{profile.version} (the plan " \
            "was made from the catalogue's figures)"
    return f"re-planned for the live cluster's {live} (the plan was for {planned or 'nothing'})"


def plan_for_live_cluster(spec_doc: Mapping[str, Any], plan: Mapping[str, Any] | None, settings: Settings,
                          topology: Topology, *, profile: HardwareProfile | None = None,
                          ) -> tuple[Plan | None, str | None]:
    """(a new plan, None) for a job whose plan is for another GPU type than the live cluster's
    (settings.gpu_type), that has none, or that was made from the catalogue while `profile` (measured)
    exists; (None, None) when its plan stands; (None, why) when no plan fits the live cluster. Pure:
    touches no database."""
    current = plan or {}
    planned = _canonical_gpu((current.get("cluster") or {}).get("gpu_type"))
    from_catalogue = profile is not None and not current.get("profile")
    if current.get("layout") and planned == _canonical_gpu(settings.gpu_type) and not from_catalogue:
        return None, None
    try:
        spec = JobSpec.model_validate(spec_doc)
        model = spec.model_spec()
        given = spec.layout_given()
        alive = [n for n in topology.gpu_nodes if n.alive]
        total = sum(n.gpus_total for n in alive)
        per_rack = max((len(ns) for ns in topology.racks.values()), default=1)
        num_gpus = spec.resources.gpus or (
            layout_gpus(model, given, spec.train.global_batch, total) if given is not None else total
        )
        cluster = ClusterSpec(
            gpu_type=settings.gpu_type, num_gpus=max(1, num_gpus),
            gpus_per_node=topology.gpus_per_node() or settings.embedded_gpus_per_node,
            nodes_per_rack=max(1, per_rack), profile=profile,
        )
        train = TrainSpec(global_batch=spec.train.global_batch, seq_len=model.seq_len,
                          precision=spec.train.precision or default_precision(cluster.gpu_type),
                          shadow_optimizer=spec.fault_tolerance.shadow_optimizer)
        return plan_layout(model, train, cluster, given, allow_unfit=spec.allow_unfit), None
    except (PlannerError, ValueError) as e:
        return None, f"no feasible plan for the live cluster ({settings.gpu_type}): {e}"


def scaling_policy(spec: JobSpec, plan: Mapping[str, Any] | None) -> ScalingPolicy | None:
    """An elastic job's controller shrinks when capacity is short and grows back when it returns
    (workers.controller.elastic), between min_gpus and max_gpus (unset: the world size planned before
    any replan); None (hold the layout) otherwise."""
    ft = spec.fault_tolerance
    if not ft.elastic:
        return None
    planned = (plan or {}).get("planned_layout") or (plan or {}).get("layout")
    max_gpus = ft.max_gpus or (Layout.from_dict(planned).world_size if planned else None)
    return elastic_policy(ft.min_gpus, max_gpus)


def controller_options(settings: Settings, spec: JobSpec, seq: int, reached_step: int,
                       defaults: Mapping[str, Any]) -> ControllerOptions:
    """The job's controller options: its hang timeout, the faults still ahead of `reached_step`
    (only with settings.fault_injection; the controller validates and carries them out), and the
    event numbering continuing after `seq`."""
    model = spec.model_spec()
    faults: tuple[dict[str, Any], ...] = ()
    if settings.fault_injection:
        faults = tuple(f.model_dump(exclude_none=True) for f in spec.faults if f.at_step > reached_step)
    fields: dict[str, Any] = {
        "hang_timeout_s": spec.fault_tolerance.heartbeat_timeout_s or settings.heartbeat_timeout_s,
        "first_seq": seq,
        "faults": faults,
        "flops_per_token": flops_per_token(model, model.seq_len),
        "log_max_bytes": settings.rank_log_max_bytes,
        "log_backups": settings.rank_log_backups,
        "spares": settings.spares_per_job if (n := spec.fault_tolerance.spares) is None else n,
        "warm_workers": settings.warm_workers_per_node,
        "warm_standby": warm_standby(settings),
        **defaults,
    }
    fields["first_seq"] = seq  # events continue the job's numbering whatever the defaults say
    return ControllerOptions(**fields)


def fail_job(sf: sessionmaker[Session], job_id: str, reason: str) -> None:
    """Fail a job that cannot run; a job that changed meanwhile is left alone."""
    try:
        with store.session_scope(sf) as s:
            store.transition(s, job_id, JobState.FAILED, reason=reason)
    except (ConcurrentUpdate, IllegalTransition) as e:
        log.info("job %s: not failed (%s)", job_id, e)


def waiting_reason(layout: Layout, topology: Topology, error: Exception | str) -> str:
    """Why a queued job's layout does not fit the free GPUs now, first in a few words ("no node with
    4 free GPUs", "needs 8 GPUs, 6 free"), then the placement's full answer."""
    usable = topology.schedulable_nodes()
    free = sum(n.gpus_free for n in usable)
    most = max((n.gpus_free for n in usable), default=0)
    if layout.tp > most:
        head = f"no node with {layout.tp} free GPU{'s' if layout.tp > 1 else ''}"
    elif free < layout.world_size:
        head = f"needs {layout.world_size} GPUs, {free} free"
    else:
        return str(error)
    return f"{head} ({error})"


class WaitingNotes:
    """Why each queued job waits: a `waiting` event per distinct reason, never the same one twice."""

    def __init__(self, sf: sessionmaker[Session], rsf: sessionmaker[Session]) -> None:
        self._sf, self._rsf = sf, rsf
        self._reasons: dict[str, str] = {}

    def note(self, job_id: str, reason: str, state: str = JobState.QUEUED) -> None:
        if job_id not in self._reasons:
            with self._rsf() as s:
                last = store.list_events(s, job_id, limit=None, types=["waiting"])
            if last:
                self._reasons[job_id] = str(last[-1].payload.get("reason"))
        if self._reasons.get(job_id) == reason:
            return
        self._reasons[job_id] = reason
        with store.session_scope(self._sf) as s:
            store.append_event(s, job_id, "waiting", {"reason": reason})
            store.update_progress(s, job_id, reason=f"{state}: {reason}"[:2000])
        log.info("job %s waits: %s", job_id, reason)

    def forget(self, job_id: str) -> None:
        self._reasons.pop(job_id, None)
