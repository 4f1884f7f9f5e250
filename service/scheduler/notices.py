"""The scheduler's preemption notices: node drains (the API's and the cloud's notice files), and room
made for a higher-priority job or for a tenant taking back the GPUs it lent (service.scheduler.preemption
chooses the victims). The notice itself
goes to the job's controller through workers.client (`ControllerClient.preempt`); the controller
answers with a PREEMPTED snapshot that the ingest turns into `queued` (service.scheduler.ingest)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from service import store
from service.scheduler import preemption
from service.scheduler.attached import Attached, held_gpus
from service.scheduler.cluster import free_view
from service.store.models import Job, Node, NodeHealth, Tenant
from training.config.layout import Layout
from workers.client import ControllerError, ControllerState
from workers.placement import PlacementError, place
from workers.topology import Topology

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 120.0
HOLD_BACK_S = 600.0  # the longest a victim lets the job it made room for start first
_TRAINING = frozenset({ControllerState.RUNNING, ControllerState.CHECKPOINTING})


def _policy(job: Job) -> tuple[bool, float]:
    """(preemptible, grace_s) from the job's stored spec (its defaults when absent)."""
    doc = (job.spec or {}).get("preemption") or {}
    return bool(doc.get("preemptible", True)), float(doc.get("grace_s", DEFAULT_GRACE_S))


def _nodes(a: Attached) -> set[str]:
    return set(a.gpus_by_node())


def _freed_view(topology: Topology, attached: Mapping[str, Attached], victims: set[str]) -> Topology:
    """The free GPUs once `victims` have stopped: Ray's free counts plus what the victims hold, less
    what the other attached jobs hold or are about to reserve."""
    freed = held_gpus(a for j, a in attached.items() if j in victims)
    others = held_gpus(a for j, a in attached.items() if j not in victims)
    nodes = tuple(dataclasses.replace(n, gpus_free=max(0, min(n.gpus_free + freed.get(n.name, 0),
                                                              n.gpus_total - others.get(n.name, 0))))
                  for n in topology.nodes)
    return dataclasses.replace(topology, nodes=nodes)


class Preemptor:
    """Drained nodes and the notices sent; `drain` is called from API threads, the rest from the loop."""

    def __init__(self, sf: sessionmaker[Session], rsf: sessionmaker[Session], notice_dir: Path | None,
                 timeout_s: float) -> None:
        self._sf, self._rsf = sf, rsf
        self._notice_dir = notice_dir
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._drains: dict[str, str] = {}  # node -> why it drains
        self._seen_cordoned: set[str] = set()  # drained nodes the ledger has shown cordoned
        self.sent: dict[str, str] = {}  # job id -> the notice's reason (until the job is detached)
        # victim job id -> (the queued job it made room for, until when it gives that job the lead)
        self._made_room: dict[str, tuple[str, float]] = {}

    def drain(self, node: str, why: str) -> None:
        """The node is cordoned in the store; preempt every job with ranks on it (next tick)."""
        with self._lock:
            self._drains[node] = why

    def forget(self, job_id: str) -> None:
        self.sent.pop(job_id, None)

    def take_notices(self) -> None:
        """Cloud preemption notices (files, service.scheduler.preemption.read_notices) cordon and
        drain their nodes, and drains recorded in the store by any API replica join them (before the
        tick reads the node ledger)."""
        for node in preemption.read_notices(self._notice_dir):
            if self._cordon(node):
                self.drain(node, f"cloud preemption notice for node {node}")
        with self._rsf() as s:
            recorded = s.execute(
                select(Node.id, Node.drain_reason).where(
                    Node.drain_reason.is_not(None), Node.health == NodeHealth.CORDONED.value)
            ).all()
        for node, why in recorded:
            self.drain(node, why)

    def tick(self, attached: Mapping[str, Attached], cordoned: frozenset[str]) -> None:
        """Drains send their notices to the jobs with ranks on the node; an uncordoned node ends its
        drain."""
        with self._lock:  # a ledger read before the drain's cordon committed does not end it
            for node in list(self._drains):
                if node in cordoned:
                    self._seen_cordoned.add(node)
                elif node in self._seen_cordoned:
                    del self._drains[node]
                    self._seen_cordoned.discard(node)
            drains = dict(self._drains)
        if not drains:
            return
        on = preemption.jobs_on_nodes(((j, _nodes(a)) for j, a in attached.items()), drains)
        for job_id in on:
            node = next(n for n in sorted(_nodes(attached[job_id])) if n in drains)
            self.send(attached[job_id], f"node {node} drains ({drains[node]})")

    def _cordon(self, node: str) -> bool:
        with store.session_scope(self._sf) as s:
            row = s.get(Node, node)
            if row is None:
                log.warning("preemption notice for unknown node %r ignored", node)
                return False
            if row.health not in (NodeHealth.CORDONED.value, NodeHealth.QUARANTINED.value,
                                  NodeHealth.DEAD.value):
                store.set_node_health(s, node, NodeHealth.CORDONED)
        return True

    def send(self, a: Attached, reason: str) -> bool:
        """Send a preemption notice once per attachment; a non-preemptible job is left alone."""
        if a.job_id in self.sent or a.cancel_sent:
            return False
        with self._rsf() as s:
            preemptible, grace_s = _policy(store.get_job(s, a.job_id))
        if not preemptible:
            self.sent[a.job_id] = "not preemptible"
            log.info("job %s is not preemptible; not preempted (%s)", a.job_id, reason)
            return False
        try:
            a.controller.preempt(reason, grace_s, timeout_s=self._timeout_s)
        except ControllerError as e:
            log.warning("job %s: preemption notice not delivered: %s", a.job_id, e)
            return False
        self.sent[a.job_id] = reason
        log.info("job %s: preemption notice sent (%s)", a.job_id, reason)
        return True

    def in_flight(self, attached: Mapping[str, Attached]) -> list[str]:
        return sorted(j for j, why in self.sent.items() if j in attached and why != "not preemptible")

    def make_room(self, job_id: str, layout: Layout, topology: Topology, attached: Mapping[str, Attached],
                  *, for_priority: bool = True, reclaim: bool = False) -> str | None:
        """Preempt other tenants' jobs on borrowed GPUs (`reclaim`, for a job within its tenant's
        quota), else lower-priority jobs (`for_priority`), so that `job_id` fits; the waiting reason
        if it did (or is waiting for earlier victims), None if no set of victims makes room."""
        flying = self.in_flight(attached)
        if flying:  # one round of victims at a time; the job they make room for says so
            if job_id not in {target for target, _ in self._made_room.values()}:
                return None
            return f"waiting for preempted job(s) {', '.join(flying)} to checkpoint and stop"
        if not (for_priority or reclaim):
            return None
        with self._rsf() as s:
            job = store.get_job(s, job_id)
            priority, tenant = job.priority, job.tenant
            lent = s.execute(select(Job.tenant, Job.progress).where(Job.id.in_(list(attached)))).all()
            if not for_priority and not any(t != tenant and (doc or {}).get("borrowing") for t, doc in lent):
                return None  # nothing lent to take back (one query, not one per attached job)
            row = s.get(Tenant, tenant)
            quota = row.gpu_quota if row is not None else None
            candidates = [self._candidate(s, a) for a in attached.values()]
        view = free_view(topology, held_gpus(attached.values()))
        free = sum(n.gpus_free for n in view.schedulable_nodes())
        if reclaim:
            victims = preemption.choose_reclaim(layout.world_size, free, tenant, quota, candidates)
            if victims and self._fits(layout, topology, attached, victims):
                self._notify(job_id, attached, {v.job_id: f"reclaim: tenant {tenant} takes back {v.gpus} "
                                                f"GPUs lent to tenant {v.tenant}" for v in victims})
                return (f"reclaiming borrowed GPUs: preempting job(s) "
                        f"{', '.join(sorted(v.job_id for v in victims))}")
        if not for_priority:
            return None
        victims = preemption.choose_victims(layout.world_size, free, priority, candidates)
        if not victims or not self._fits(layout, topology, attached, victims):
            return None
        self._notify(job_id, attached, {v.job_id: f"preempted for job {job_id} (priority {priority})"
                                        for v in victims})
        ids = ", ".join(sorted(v.job_id for v in victims))
        return f"preempting job(s) {ids} (lower priority) to make room"

    @staticmethod
    def _fits(layout: Layout, topology: Topology, attached: Mapping[str, Attached],
              victims: list[preemption.Candidate]) -> bool:
        """Whether the GPUs the victims free would make a placement."""
        try:
            place(layout, _freed_view(topology, attached, {v.job_id for v in victims}))
        except PlacementError:
            return False
        return True

    def _notify(self, job_id: str, attached: Mapping[str, Attached], reasons: Mapping[str, str]) -> None:
        """Send each victim its notice; a victim notified holds back until `job_id` has started."""
        for victim, reason in reasons.items():
            if self.send(attached[victim], reason):
                self._made_room[victim] = (job_id, time.monotonic() + HOLD_BACK_S)

    def held_back(self, job_id: str) -> str | None:
        """Why a victim must not start again yet: the job it made room for is still queued (else it
        could take the GPUs back, and be preempted again); None once that job has started."""
        waiting_for, until = self._made_room.get(job_id, (None, 0.0))
        if waiting_for is None:
            return None
        with self._rsf() as s:
            job = s.get(Job, waiting_for)
            if job is not None and job.state == "queued" and time.monotonic() < until:
                return f"preempted for job {waiting_for}, which starts first"
        del self._made_room[job_id]
        return None

    def _candidate(self, s: Session, a: Attached) -> preemption.Candidate:
        job = store.get_job(s, a.job_id)
        preemptible, _ = _policy(job)
        last = store.latest_checkpoint(s, a.job_id)
        since = max(0, job.step - (last.step if last is not None else 0))
        doc: dict[str, Any] = job.progress or {}
        gpus = sum(a.gpus_by_node().values())
        return preemption.Candidate(a.job_id, gpus, job.priority, since, bool(doc.get("borrowing")),
                                    preemptible and a.job_id not in self.sent
                                    and a.controller_state in _TRAINING, job.tenant)


def note_resumed(s: Session, job_id: str, step: int) -> None:
    """A job that last went back to the queue by preemption starts again: its `resumed` event (the
    step it resumes from: the checkpoint it took when preempted)."""
    for event in reversed(store.list_events(s, job_id, limit=None, types=["state"])):
        if event.payload.get("to") == "queued":
            if event.payload.get("preempted"):
                store.append_event(s, job_id, "resumed", {"after": "preemption", "step": step,
                                                          "message": f"resuming from step {step} after a "
                                                          "preemption"})
            return
