"""Attribution: which nodes a failure counts against, and what follows for them. Only an
infrastructure fault is attributed (workers.controller.classify: a job error or an unknown failure
blames nobody). Keeps the node ledger (suspect, quarantined, dead: one job's faults alone never
quarantine a node unless `quarantine_jobs` is 1), the service's health and cordon view, the nodes a
restart avoids, asks a referee to settle a persistent SDC between two replicas, and chooses between the
fast path (replace only the failed ranks) and a full restart."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from training.config.run import RunConfig
from workers.controller.attempt import Attempt
from workers.controller.eventlog import EventLog
from workers.events import NODE_HEALTH_EVENT, Attribution, EventKind, NodeHealthChange
from workers.fault_ledger import NodeLedger
from workers.policies import Failure, FailureDecision, FailureKind
from workers.referee import decide

# referee(run_cfg, request, exclude_nodes) replays a step on a spare (workers.referee.RayReferee).
Referee = Callable[[RunConfig, Mapping[str, Any], Collection[str]], Mapping[str, Any]]


class Attributor:
    def __init__(
        self,
        events: EventLog,
        *,
        job_id: str = "",
        quarantine_after: int,
        quarantine_jobs: int = 2,
        fast_path: bool,
        use_referee: bool,
        health: Mapping[str, str] | None = None,
        cordoned: Collection[str] = (),
        referee: Referee | None = None,
    ) -> None:
        self.job_id = job_id
        self.nodes = NodeLedger(quarantine_after=quarantine_after, min_jobs=quarantine_jobs)
        self.health: dict[str, str] = dict(health or {})  # the service's health ledger
        self.cordoned: set[str] = set(cordoned)
        self.exclude: set[str] = set()  # nodes the next placement avoids when it can
        self.referee = referee
        self._events = events
        self._fast_path = fast_path
        self._use_referee = use_referee

    def health_view(self) -> dict[str, str]:
        """The service's health with this job's findings over it (a suspect never hides worse news)."""
        view = dict(self.health)
        for n, h in self.nodes.health.items():
            if h == "suspect" and view.get(n, "ready") != "ready":
                continue
            view[n] = h
        return view

    def bad_nodes(self) -> set[str]:
        return self.nodes.in_state("quarantined", "dead") | set(self.cordoned)

    def attribute(self, failure: Failure, decision: FailureDecision) -> None:
        """Report whom the infrastructure fault `failure` is attributed to and record it against
        their nodes (the caller attributes only failures that blame nodes)."""
        if failure.ranks or failure.nodes:
            transient = failure.evidence.get("evidence", {}).get("transient") if failure.evidence else None
            self._events.emit(EventKind.ATTRIBUTED, f"{failure.kind} attributed to rank(s) "
                              f"{list(failure.ranks)} on node(s) {list(failure.nodes)}",
                              Attribution(list(failure.ranks), list(failure.nodes), str(failure.kind),
                                          failure.evidence, transient))
        quarantine = set(decision.quarantine_nodes)
        for n in sorted(set(decision.suspect_nodes) | quarantine | set(failure.nodes)):
            if failure.kind == FailureKind.STARTUP and n not in quarantine:
                continue
            self.mark_node(n, failure, quarantine=n in quarantine,
                           dead=failure.kind == FailureKind.NODE_DIED and n in failure.nodes)

    def avoid(self, failure: Failure, decision: FailureDecision) -> None:
        """The nodes the restart stays off when it can: the policy's, a straggler's own, and the
        nodes with `quarantine_after` faults of this job (kept off by this job, not quarantined)."""
        self.exclude = set(decision.exclude_nodes)
        if failure.kind == FailureKind.STRAGGLER:
            self.exclude |= set(failure.nodes)
        limit = self.nodes.quarantine_after
        self.exclude |= {n for n, count in self.nodes.faults.items() if count >= limit}

    def mark_node(self, node: str, failure: Failure, *, quarantine: bool = False, dead: bool = False) -> None:
        new = self.nodes.record(node, job=self.job_id, quarantine=quarantine, dead=dead)
        if new is None:
            return
        count = self.nodes.faults[node]
        why = str(failure.kind)
        if quarantine:
            why = "confirmed SDC"
        elif new == "quarantined":
            why = f"{count} fault(s) from {len(self.nodes.fault_jobs.get(node, ()))} job(s)"
        self._events.emit(NODE_HEALTH_EVENT[new], f"node {node} is {new} after {why}",
                          NodeHealthChange(node, new, count, str(failure.kind)))

    def fast_path_ranks(self, failure: Failure) -> list[int]:
        """Ranks to replace while the others keep their processes, or [] for a full restart. Ranks
        on nodes that must not be used again move (the worker group relocates them, TP groups whole)."""
        kinds = (FailureKind.RANK_DIED, FailureKind.HANG, FailureKind.NODE_DIED, FailureKind.STRAGGLER)
        if not self._fast_path or failure.kind not in kinds or not failure.ranks:
            return []
        return sorted(failure.ranks)

    def ask_referee(self, failure: Failure, run_cfg: RunConfig, attempt: Attempt) -> Failure:
        """Two replicas that disagreed again on the re-run (a persistent SDC with DP = 2): a spare
        on a healthy node replays the step; the replica it does not agree with is the culprit."""
        ev = failure.evidence.get("evidence") or {}
        request = ev.get("referee")
        if not request or self.referee is None or not self._use_referee:
            return failure
        suspects = attempt.nodes([int(r) for r in request.get("dp_group", [])])
        exclude = set(suspects) | self.bad_nodes()
        step = request.get("step")
        self._events.emit(EventKind.REFEREE_STARTED, f"replicas {request.get('dp_group')} disagree again on "
                          f"the re-run of step {step}: replaying it on a spare outside node(s) "
                          f"{list(suspects)}",
                          step=step, dp_group=request.get("dp_group"), suspects=list(suspects))
        try:
            result = dict(self.referee(run_cfg, request, exclude))
        except Exception as e:  # noqa: BLE001 - a referee that cannot run names nobody
            result = {"error": f"{type(e).__name__}: {e}"}
        culprits, healthy = decide(request, result)
        record = {**{k: v for k, v in request.items() if k != "snapshot"}, "node": result.get("node"),
                  "fingerprint": result.get("fingerprint"), "culprits": culprits, "healthy": healthy,
                  "warm_spare": bool(result.get("warm_spare"))}
        if not culprits:
            why = result.get("error") or "its result matches neither replica"
            self._events.emit(EventKind.REFEREE_INCONCLUSIVE, f"the referee could not tell the replicas "
                              f"apart: {why}", step=step, referee={**record, "error": why})
            return failure
        nodes = attempt.nodes(culprits)
        self._events.emit(EventKind.REFEREE, f"a spare on node {result.get('node')} replayed step {step}: "
                          f"rank(s) {healthy} computed it correctly, rank(s) {culprits} on node(s) "
                          f"{list(nodes)} did not", step=step, referee=record)
        evidence = {**failure.evidence, "ranks": culprits,
                    "evidence": {**ev, "referee": record, "ambiguous": False,
                                 "attribution": "referee replay on a spare"}}
        return Failure(FailureKind.SDC, f"persistent SDC at step {step} on rank(s) {culprits} (a spare on "
                       f"{result.get('node')} reproduced the other replica)", tuple(culprits), nodes,
                       failure.step, evidence=evidence)

    @property
    def suspect_nodes(self) -> list[str]:
        return sorted(self.nodes.in_state("suspect"))

    @property
    def quarantined_nodes(self) -> list[str]:
        return sorted(self.nodes.in_state("quarantined"))
