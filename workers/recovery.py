"""The fault-handling half of the controller's state machine (issue 6), as a mixin of
`workers.state_machine.ControllerStateMachine`: what the ranks report about faults, the controller-
side faults they trigger (kill_node, corrupt_checkpoint), checkpoint scrubbing, attribution of deaths
and hangs, the node ledger and the choice between the fast path and a full restart.

Everything here runs on the state machine's attributes (see its __init__); it is split out only
to keep one concern per file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from workers.faults import normalize_faults
from workers.policies import Failure, FailureAction, FailureKind
from workers.worker_group import GroupStatus

if TYPE_CHECKING:
    from workers.state_machine import Transition


def _states() -> Any:
    from workers.state_machine import ControllerState

    return ControllerState


class FaultHandling:
    """Mixed into ControllerStateMachine."""

    # Provided by ControllerStateMachine.
    _lock: Any
    _wall: Any

    def report(self, rank: int, event: Mapping[str, Any]) -> None:
        """An event a rank sent directly (e.g. just before it kills itself); read with the next poll."""
        with self._lock:
            self._inbox.append((rank, dict(event)))

    def inject(self, fault: Mapping[str, Any]) -> None:
        """Add a fault while the job runs (POST /v1/jobs/{id}/faults)."""
        (f,) = normalize_faults([dict(fault)])
        with self._lock:
            self._pending_faults.append(f)
        if self.state in (_states().RUNNING, _states().CHECKPOINTING):
            params = {k: v for k, v in f.items() if k not in ("kind", "rank", "at_step")}
            self.wg.inject_fault(f["kind"], int(f.get("rank") or 0), f["at_step"], **params)

    def trigger(self, rank: int, fault: Mapping[str, Any]) -> str:
        """Carry out a controller-side fault a rank reached (kill_node, corrupt_checkpoint); called
        from the rank, which waits (a kill_node of its own node never returns to it)."""
        kind, step = fault.get("kind"), fault.get("step")
        with self._lock:
            self._drop_pending(kind, rank, step)
            self._fired.add((kind, rank, fault.get("phase", "step"), step))
        if kind == "corrupt_checkpoint":
            self._corrupted_at[int(step)] = self._wall()
            path = str(fault.get("path") or "")
            if self._ckpt_ops is None or not path:
                raise RuntimeError("no checkpoint to damage")
            which, mode = fault.get("which", "any"), fault.get("mode", "flip")
            # Logged first: the loop thread may scrub this checkpoint as soon as it is damaged.
            self._event("fault_injected", f"corrupt_checkpoint: damaging {which} of the checkpoint of "
                        f"step {step} ({mode})", fault=kind, step=step, path=path, which=which, rank=rank)
            return self._ckpt_ops.corrupt(path, which, mode)
        if kind != "kill_node":
            raise ValueError(f"{kind} is not a controller-side fault")
        node = fault.get("node") or self._rank_node.get(rank)
        if not node:
            raise RuntimeError(f"kill_node: rank {rank}'s node is unknown")
        self.clock.fault(self._wall())
        self._event("fault_injected", f"kill_node: removing node {node} at step {step}", fault=kind,
                    node=node, step=step, phase=fault.get("phase", "step"), rank=rank)
        try:
            if self._node_killer is None:
                raise RuntimeError("no node killer")
            self._node_killer(node)
        except Exception as e:  # noqa: BLE001 - fall back to a simulated death of the node
            self._dead_nodes.add(node)
            killed = self.wg.kill_ranks_on_node(node)
            self._event("fault_note", f"no cluster owner removed {node} ({e}); killed its ranks {killed} "
                        "and marked it dead", node=node)
        return node

    def _on_fault_fired(self, rank: int, ev: Mapping[str, Any]) -> None:
        fault, at = ev.get("fault"), ev.get("step")
        key = (fault, rank, ev.get("phase", "step"), at)
        if key in self._fired:
            return  # the controller heard it directly before the rank died, then from the rank
        self._fired.add(key)
        self._drop_pending(fault, rank, at)
        self.clock.fault(float(ev.get("t_fault") or ev.get("t") or self._wall()))
        extra = {k: ev[k] for k in ("target", "name", "index", "bit", "seconds", "phase") if k in ev}
        self._event("fault_injected", f"{fault} on rank {rank} at step {at}",
                    rank=rank, node=self._rank_node.get(rank), fault=fault, step=at, **extra)

    def _drop_pending(self, kind: Any, rank: int, step: Any) -> None:
        """The earliest pending fault of this kind on this rank has fired."""
        for f in sorted(self._pending_faults, key=lambda f: f["at_step"]):
            if f.get("kind") == kind and int(f.get("rank") or 0) == rank and (
                not isinstance(step, int) or f["at_step"] <= step
            ):
                self._pending_faults.remove(f)
                return

    def _on_restored(self, step: Any) -> None:
        self._restored_seen = True
        restored = int(step) if isinstance(step, int) else 0
        reached = self._reached
        dropped = self.data.rollback(restored)
        if restored:
            self._fill_data(restored)
        if reached is not None:
            lost = max(reached - restored, 0)
            self.clock.lost(lost)
            self._event("restore", f"restored the verified checkpoint of step {restored}; "
                        f"{lost} step(s) lost", step=restored, steps_lost=lost,
                        verified=sorted(self.ckpts.verified), corrupt=sorted(self.ckpts.corrupt))
            self._reached = None
        elif dropped:
            self.clock.lost(dropped)
        self.progress["step"] = restored
        self._attempt_step = restored

    def _fill_data(self, restored: int) -> None:
        try:
            from training.data import make_data_source

            cfg = self.run_cfg
            source = make_data_source(cfg.data, cfg.model, cfg.global_batch)
            dp = cfg.layout.dp
            self.data.fill(restored, dp, lambda s, r: source.positions(s, r, dp))
        except Exception as e:  # noqa: BLE001 - the ledger stays as reported
            import logging

            logging.getLogger(__name__).warning("could not complete the data ledger: %s", e)

    def _on_checkpoint_committed(self, step: int, path: str) -> None:
        self.ckpts.committed[step] = path
        self._scrub(step, path)

    def _scrub(self, step: int, path: str) -> bool:
        """Check a committed checkpoint against its manifest; a damaged one is never restored."""
        ops = self._ckpt_ops
        if ops is None or not path or step in self.ckpts.corrupt or step in self._scrubbed:
            return step not in self.ckpts.corrupt
        self._scrubbed.add(step)
        try:
            ops.verify(path)
        except Exception as e:  # noqa: BLE001 - any verification failure makes the checkpoint unusable
            why = str(e)
            self.ckpts.mark_corrupt(step, why)
            now = self._wall()
            damaged_at = self._corrupted_at.get(step)
            # Its own incident, which needs no restart (the checkpoint is simply never used); it
            # leaves a recovery in progress alone.
            incident = self.clock.note("checkpoint", now, None if damaged_at is None else now - damaged_at)
            self._event("failure", f"checkpoint of step {step} does not verify: {why}",
                        failure=Failure(FailureKind.CHECKPOINT, why, step=step,
                                        evidence={"path": path}).to_dict(),
                        detected_by="manifest verification", time_to_detect_s=incident["time_to_detect_s"])
            self._event("attributed", f"checkpoint of step {step} is damaged; it will never be restored",
                        step=step, path=path, cause="checkpoint", evidence={"manifest": why})
            if self.state in (_states().RUNNING, _states().CHECKPOINTING):
                self.wg.request_action("checkpoint")  # replace it with a good one at the next step
            return False
        self._event("checkpoint_verified", f"checkpoint of step {step} verifies against its manifest",
                    step=step, verified=step in self.ckpts.verified)
        return True

    def _scrub_candidates(self) -> None:
        """Before a restart: verify every checkpoint on disk not checked yet (at most `keep` of them;
        a rank that died may never have reported its part of a save, so its commit went unseen)."""
        ops, root = self._ckpt_ops, self.run_cfg.checkpoint.dir
        if ops is None or not root or not hasattr(ops, "list"):
            return
        for step in sorted(ops.list(root), reverse=True):
            self.ckpts.committed.setdefault(step, f"{root}/step-{step}")
            self._scrub(step, self.ckpts.committed[step])

    def _node_gone(self, rank: int) -> bool:
        node = self._rank_node.get(rank)
        return bool(node) and (node in self._dead_nodes or not self.wg.node_alive(node))

    def _death(self, ranks: list[int], status: GroupStatus, step: Any) -> Failure:
        nodes = self._nodes(ranks)
        gone = [n for n in nodes if n in self._dead_nodes or not self.wg.node_alive(n)]
        errors = {r: status.ranks[r].error for r in ranks}
        if gone:
            on_gone = tuple(r for r in ranks if self._rank_node.get(r) in gone)
            return Failure(FailureKind.NODE_DIED, f"node(s) {gone} died with rank(s) {list(on_gone)}",
                           on_gone, tuple(gone), step, evidence={"errors": errors})
        return Failure(FailureKind.RANK_DIED, f"rank(s) {ranks} died: {status.ranks[ranks[0]].error}",
                       tuple(ranks), nodes, step, evidence={"errors": errors})

    def _hang(self, stale: list[int], status: GroupStatus, step: Any) -> Failure:
        # Everyone waits in the collective the hung rank never joined: the culprits are the ranks
        # whose last report is furthest behind ((step, entered the collective)), then the ones
        # that stopped earliest (lowest step, then longest silence).
        markers = {r: self._markers.get(r) for r in stale}
        evidence: dict[str, Any] = {"stale_ranks": stale,
                                    "last_report": {str(r): m for r, m in markers.items()}}
        known = {r: m for r, m in markers.items() if m is not None}
        if len(known) == len(stale) and len(set(known.values())) > 1:
            low = min(known.values())
            culprits = sorted(r for r, m in known.items() if m == low)
            waiting = sorted(r for r, m in known.items() if m != low)
            evidence["waiting_in_collective"] = waiting
            longest = max(status.ranks[r].since_progress_s for r in culprits)
            return Failure(FailureKind.HANG, f"rank(s) {culprits} never entered the step-{low[0]} collective "
                           f"that rank(s) {waiting} wait in ({longest:.0f}s)", tuple(culprits),
                           self._nodes(culprits), step, evidence=evidence)
        low_step = min((status.ranks[r].step or 0) for r in stale)
        behind = [r for r in stale if (status.ranks[r].step or 0) == low_step]
        longest = max(status.ranks[r].since_progress_s for r in behind)
        culprits = sorted(r for r in behind if status.ranks[r].since_progress_s >= longest - 1.0)
        return Failure(FailureKind.HANG, f"no progress from rank(s) {culprits} for {longest:.0f}s "
                       f"(timeout {self._progress_timeout(True):.0f}s)", tuple(culprits),
                       self._nodes(culprits), step, evidence=evidence)

    def _on_failure(self, failure: Failure) -> Transition | None:
        self._failure = failure
        if failure.kind == FailureKind.STRAGGLER and self.options.straggler_action == "report":
            self._event("straggler", failure.message, failure=failure.to_dict())
            for n in failure.nodes:
                self._mark_node(n, failure)
            return None
        incident = self.clock.detected(str(failure.kind), self._wall())
        self._reached = self._attempt_step or (self.progress["step"] or 0)
        detector = _DETECTORS.get(failure.kind, str(failure.kind))
        self._event("failure", failure.message, failure=failure.to_dict(), detected_by=detector,
                    time_to_detect_s=incident["time_to_detect_s"])
        if failure.kind == FailureKind.SDC:
            failure = self._failure = self._ask_referee(failure)
        decision = self.failure_policy.decide(failure, self.restarts)
        if failure.ranks or failure.nodes:
            transient = failure.evidence.get("evidence", {}).get("transient") if failure.evidence else None
            self._event("attributed", f"{failure.kind} attributed to rank(s) {list(failure.ranks)} on "
                        f"node(s) {list(failure.nodes)}", ranks=list(failure.ranks),
                        nodes=list(failure.nodes), cause=str(failure.kind), evidence=failure.evidence,
                        transient=transient)
        quarantine = set(decision.quarantine_nodes)
        for n in sorted(set(decision.suspect_nodes) | quarantine | set(failure.nodes)):
            if failure.kind == FailureKind.STARTUP and n not in quarantine:
                continue
            self._mark_node(n, failure, quarantine=n in quarantine,
                            dead=failure.kind == FailureKind.NODE_DIED and n in failure.nodes)
        if decision.action == FailureAction.RAISE:
            return self.fail(decision.reason)
        self._exclude = set(decision.exclude_nodes)
        if failure.kind == FailureKind.STRAGGLER:
            self._exclude |= set(failure.nodes)
        self._fast_ranks = self._fast_path_ranks(failure)
        return self._to(_states().RECOVERING, decision.reason)

    def _ask_referee(self, failure: Failure) -> Failure:
        """Two replicas that disagreed again on the re-run (a persistent SDC with DP = 2): a spare
        on a healthy node replays the step; the replica it does not agree with is the culprit."""
        ev = failure.evidence.get("evidence") or {}
        request = ev.get("referee")
        if not request or self._referee is None or not self.options.referee:
            return failure
        from workers.referee import decide

        suspects = self._nodes([int(r) for r in request.get("dp_group", [])])
        exclude = set(suspects) | self.nodes.in_state("quarantined", "dead") | set(self._cordoned)
        step = request.get("step")
        self._event("referee_started", f"replicas {request.get('dp_group')} disagree again on the re-run of "
                    f"step {step}: replaying it on a spare outside node(s) {list(suspects)}",
                    step=step, dp_group=request.get("dp_group"), suspects=list(suspects))
        try:
            result = dict(self._referee(self.run_cfg, request, exclude))
        except Exception as e:  # noqa: BLE001 - a referee that cannot run names nobody
            result = {"error": f"{type(e).__name__}: {e}"}
        culprits, healthy = decide(request, result)
        record = {**{k: v for k, v in request.items() if k != "snapshot"}, "node": result.get("node"),
                  "fingerprint": result.get("fingerprint"), "culprits": culprits, "healthy": healthy}
        if not culprits:
            why = result.get("error") or "its result matches neither replica"
            self._event("referee_inconclusive", f"the referee could not tell the replicas apart: {why}",
                        step=step, referee={**record, "error": why})
            return failure
        nodes = self._nodes(culprits)
        self._event("referee", f"a spare on node {result.get('node')} replayed step {step}: rank(s) "
                    f"{healthy} computed it correctly, rank(s) {culprits} on node(s) {list(nodes)} did not",
                    step=step, referee=record)
        evidence = {**failure.evidence, "ranks": culprits,
                    "evidence": {**ev, "referee": record, "ambiguous": False,
                                 "attribution": "referee replay on a spare"}}
        return Failure(FailureKind.SDC, f"persistent SDC at step {step} on rank(s) {culprits} (a spare on "
                       f"{result.get('node')} reproduced the other replica)", tuple(culprits), nodes,
                       failure.step, evidence=evidence)

    def _mark_node(
        self, node: str, failure: Failure, *, quarantine: bool = False, dead: bool = False
    ) -> None:
        new = self.nodes.record(node, quarantine=quarantine, dead=dead)
        if new is None:
            return
        kind = {"suspect": "node_suspect", "quarantined": "node_quarantined", "dead": "node_dead"}[new]
        count = self.nodes.faults[node]
        why = str(failure.kind)
        if quarantine:
            why = "confirmed SDC"
        elif new == "quarantined":
            why = f"{count} fault(s)"
        self._event(kind, f"node {node} is {new} after {why}", node=node, health=new, faults=count,
                    cause=str(failure.kind))

    def _fast_path_ranks(self, failure: Failure) -> list[int]:
        """Ranks to replace in place, or [] for a full restart."""
        if not self.options.fast_path or failure.kind not in (FailureKind.RANK_DIED, FailureKind.HANG):
            return []
        bad = self.nodes.in_state("quarantined", "dead") | self._exclude | set(self._cordoned)
        if not failure.ranks or any(n in bad for n in failure.nodes):
            return []
        return sorted(failure.ranks)

    @property
    def suspect_nodes(self) -> list[str]:
        return sorted(self.nodes.in_state("suspect"))

    @property
    def quarantined_nodes(self) -> list[str]:
        return sorted(self.nodes.in_state("quarantined"))

    def fault_stats(self) -> dict[str, Any]:
        """What the service turns into fault-tolerance metrics (restarts by cause, time to detect
        and to recover per incident, steps lost, goodput, SDC detections, node health)."""
        wall = max(self._wall() - self._started_wall, 1e-9)
        return {
            "restarts_by_cause": dict(self.clock.restarts_by_cause),
            "incidents": [dict(i) for i in self.clock.incidents],
            "steps_lost": self.clock.steps_lost,
            "sdc_detections": self.clock.sdc_detections,
            "useful_step_seconds": round(self.data.useful_seconds(), 4),
            "wall_seconds": round(wall, 3),
            "goodput": round(min(self.data.useful_seconds() / wall, 1.0), 4),
            "node_health": dict(self.nodes.health),
            "node_faults": dict(self.nodes.faults),
            "verified_steps": sorted(self.ckpts.verified),
            "corrupt_steps": sorted(self.ckpts.corrupt),
        }


_DETECTORS = {
    FailureKind.RANK_DIED: "actor death (ActorDiedError)",
    FailureKind.NODE_DIED: "node death (the node left the cluster; its actors died)",
    FailureKind.HANG: "heartbeat timeout",
    FailureKind.STRAGGLER: "collective arrival times",
    FailureKind.SDC: "integrity checks (fingerprint vote / re-run, local gradient norm, NaN/Inf, loss spike)",
    FailureKind.RANK_ERROR: "rank error",
    FailureKind.STARTUP: "startup",
    FailureKind.CHECKPOINT: "manifest verification",
}
