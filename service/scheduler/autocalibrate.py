"""Background calibration of node types that have no hardware profile (issue 16 item 1).

Each tick the leading scheduler hands its topology to `AutoCalibrator.tick`. A node's type is its
`gpu_type` label (a catalogue name or alias: `ray start --labels=rack=r1,gpu_type=H100-80GB`),
else the cluster's `LATTICE_GPU_TYPE`; profiles are keyed by the catalogue name. For a type seen
without a stored profile it starts, in a daemon thread, the quick calibration grid (seconds) as a
Ray task holding one GPU of a schedulable node of that type (`workers.calibration.calibrate_on_node`),
then stores the result as the type's next profile version, unless one was stored meanwhile (an
operator's `lattice calibrate` measures the full grid: it wins). When the type has a second schedulable
node, the collectives are also timed between the two (one rank on each:
`workers.calibration.measure_link`), the profile's inter-node tier; a type calibrated with one node keeps
the catalogue's inter-node link until a second node joins: then the link alone is timed and stored as the
next version (the rest of the newest profile kept). The tick itself only reads the store, and only for
types not yet known to have a profile with both tiers: it never waits for a calibration.

At most one calibration per type is in flight. A failure is logged and retried after a backoff that
doubles from `backoff_s` up to `max_backoff_s`. Writes go through the scheduler's fenced sessions, so a
deposed leader's late result is refused (NotLeader) and left to the new leader.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from service.errors import NotLeader
from service.settings import Settings
from service.store.db import session_scope
from service.store.profiles import newest_profile, save_profile
from training.config.hardware import find_gpu
from workers.topology import NodeInfo, Topology

log = logging.getLogger(__name__)

NODE_TYPE_LABEL = "gpu_type"
# Seconds a calibration task may take, waiting for its node included (the quick grid runs in ~2 s
# here; a fresh Ray worker importing torch on a loaded node takes the rest).
CALIBRATION_TIMEOUT_S = 120.0

# (node type, Ray node id) -> the profile document measured on that node.
Calibrate = Callable[[str, str], Mapping[str, Any]]
# (node type, Ray node id, another node's id) -> {backend, collectives} timed between the two.
MeasureLink = Callable[[str, str, str], Mapping[str, Any]]


def ray_calibrate(node_type: str, node_id: str) -> Mapping[str, Any]:
    """The quick grid as a Ray task on `node_id`, holding one of its GPUs (real on a GPU node)."""
    from workers.calibration import calibrate_on_node

    return calibrate_on_node(node_type, node_id, CALIBRATION_TIMEOUT_S, quick=True, num_gpus=1,
                             num_cpus=0.1)


def ray_measure_link(node_type: str, node_id: str, peer_id: str) -> Mapping[str, Any]:
    """The collectives between one rank on each node, each holding one of its GPUs."""
    from workers.calibration import measure_link

    return measure_link(node_id, peer_id, CALIBRATION_TIMEOUT_S, num_gpus=1, num_cpus=0.1)


@dataclasses.dataclass
class _TypeState:
    failures: int = 0
    retry_at: float = 0.0  # monotonic time before which a failed type is not tried again
    running: threading.Thread | None = None
    first_since: float | None = None  # monotonic start of the type's first calibration while it runs


class AutoCalibrator:
    """Calibrates node types without a profile, in the background; `tick` never blocks on it."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        read_session_factory: sessionmaker[Session],
        default_type: str,
        *,
        enabled: bool = True,
        calibrate: Calibrate = ray_calibrate,
        measure_link: MeasureLink = ray_measure_link,
        backoff_s: float = 30.0,
        max_backoff_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self._sf, self._rsf = session_factory, read_session_factory
        default = find_gpu(default_type)
        self._default = default.name if default is not None else default_type
        self._calibrate, self._measure_link = calibrate, measure_link
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._types: dict[str, _TypeState] = {}
        self._profiled: set[str] = set()  # types known to have a profile (profiles are never deleted)
        self._linked: set[str] = set()  # ... whose newest profile has the inter-node tier too
        self._unknown: set[str] = set()  # labels not in the catalogue, warned about once

    # ---- what the scheduler calls ----------------------------------------------------------------
    def tick(self, topology: Topology) -> list[str]:
        """Start a calibration for each node type seen without a profile, and a link measurement for
        each with a profile but no inter-node tier that now has two free nodes; the types started."""
        if not self.enabled:
            return []
        started = []
        for node_type, nodes in self.node_types(topology).items():
            if node_type in self._linked or not self._due(node_type):
                continue
            node = _pick_node(nodes)
            peer = _pick_node([n for n in nodes if n.node_id != node.node_id]) if node is not None else None
            if node is None or (peer is None and node_type in self._profiled):
                continue  # no free GPU (or no second node) of that type now: a later tick, not a failure
            with self._rsf() as s:
                newest = newest_profile(s, node_type)
            if newest is not None:
                with self._lock:
                    self._profiled.add(node_type)
                    if newest.inter_node:
                        self._linked.add(node_type)
                if newest.inter_node or peer is None:
                    continue
            self._start(node_type, node, peer, link_only=newest is not None)
            started.append(node_type)
        return started

    def node_types(self, topology: Topology) -> dict[str, list[NodeInfo]]:
        """Node type -> its live GPU nodes (labels not in the catalogue are skipped, with a warning)."""
        out: dict[str, list[NodeInfo]] = {}
        for n in topology.gpu_nodes:
            if n.is_head or not n.alive:
                continue
            label = n.labels.get(NODE_TYPE_LABEL)
            gpu = find_gpu(label) if label else None
            if label and gpu is None:
                if label not in self._unknown:
                    self._unknown.add(label)
                    log.warning("node %s: %s label %r is not a catalogue GPU type; not calibrated",
                                n.name, NODE_TYPE_LABEL, label)
                continue
            out.setdefault(gpu.name if gpu is not None else self._default, []).append(n)
        return out

    def in_flight(self) -> list[str]:
        with self._lock:
            return sorted(t for t, st in self._types.items() if st.running is not None)

    def awaiting(self, node_type: str, hold_s: float) -> str | None:
        """Why plans for `node_type` should wait a little: its first profile is being measured, started
        less than `hold_s` ago (a plan made now would use the catalogue's figures, off by an order of
        magnitude on a CPU host, and its job's ranks would skew the measurement); None otherwise."""
        gpu = find_gpu(node_type)
        name = gpu.name if gpu is not None else node_type
        with self._lock:
            st = self._types.get(name)
            since = st.first_since if st is not None and st.running is not None else None
        if not self.enabled or since is None or name in self._profiled:
            return None
        if self._clock() - since >= hold_s:
            return None
        return (f"waiting for the {name} nodes' first hardware profile, being measured now (at most "
                f"{hold_s:.0f} s, then planned from the catalogue)")

    def wait(self, timeout_s: float) -> bool:
        """Wait for the calibrations in flight to end (tests, shutdown); whether they all did."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = [st.running for st in self._types.values() if st.running is not None]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    # ---- one calibration -------------------------------------------------------------------------
    def _due(self, node_type: str) -> bool:
        with self._lock:
            st = self._types.get(node_type)
            return st is None or (st.running is None and self._clock() >= st.retry_at)

    def _start(self, node_type: str, node: NodeInfo, peer: NodeInfo | None, *, link_only: bool) -> None:
        thread = threading.Thread(target=self._run, args=(node_type, node, peer, link_only), daemon=True,
                                  name=f"lattice-calibrate-{node_type}")
        with self._lock:
            st = self._types.setdefault(node_type, _TypeState())
            st.running = thread
            st.first_since = None if link_only else self._clock()
        if link_only:
            log.info("node type %s has no inter-node link measurement: timing %s <-> %s in the background",
                     node_type, node.name, peer.name if peer is not None else "-")
        else:
            log.info("node type %s has no hardware profile: calibrating it on %s in the background",
                     node_type, node.name)
        thread.start()

    def _run(self, node_type: str, node: NodeInfo, peer: NodeInfo | None, link_only: bool) -> None:
        ok = False
        try:
            if link_only and peer is not None:
                ok = self._store_link(node_type, dict(self._measure_link(node_type, node.node_id,
                                                                          peer.node_id)["collectives"]))
            else:
                start = time.monotonic()
                doc = {**self._calibrate(node_type, node.node_id), "node_type": node_type}
                meta = doc["meta"] = dict(doc.get("meta") or {})
                if peer is not None:
                    linked = time.monotonic()
                    doc["inter_node"] = self._inter_node(node_type, node, peer)
                    meta["inter_node_s"] = round(time.monotonic() - linked, 3)
                # in all, from the start of the task: a worker to start, the node, the link
                meta["background_s"] = round(time.monotonic() - start, 3)
                ok = self._store(node_type, node, doc)
        except NotLeader as e:
            log.info("node type %s: calibrated, but this scheduler no longer leads (%s); not stored",
                     node_type, e)
            ok = True  # the new leader calibrates it if it still has no profile
        except Exception:  # a calibration must never take the scheduler down; logged and retried
            log.exception("node type %s: background calibration on %s failed", node_type, node.name)
        with self._lock:
            st = self._types[node_type]
            st.running, st.first_since = None, None
            if ok:
                st.failures = 0
            else:
                st.failures += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (st.failures - 1))
                st.retry_at = self._clock() + delay
                log.warning("node type %s: calibration failed %d time(s); next try in %.0f s",
                            node_type, st.failures, delay)

    def _inter_node(self, node_type: str, node: NodeInfo, peer: NodeInfo) -> dict[str, Any]:
        """The collectives timed between `node` and `peer`; {} (the catalogue's link) when that fails: the
        node's own measurements are still worth storing."""
        try:
            return dict(self._measure_link(node_type, node.node_id, peer.node_id)["collectives"])
        except Exception:  # logged; the profile is stored without the inter-node tier
            log.warning("node type %s: timing the link between %s and %s failed; its profile keeps the "
                        "catalogue's inter-node link", node_type, node.name, peer.name, exc_info=True)
            return {}

    def _store_link(self, node_type: str, inter_node: Mapping[str, Any]) -> bool:
        """The newest profile with the measured inter-node tier, as the type's next version."""
        with session_scope(self._sf) as s:
            newest = newest_profile(s, node_type)
            if newest is not None and not newest.inter_node:
                profile = save_profile(s, {**newest.to_dict(), "inter_node": inter_node})
                log.info("node type %s: stored hardware profile v%d with the inter-node link", node_type,
                         profile.version)
        with self._lock:
            self._linked.add(node_type)
        return True

    def _store(self, node_type: str, node: NodeInfo, doc: Mapping[str, Any]) -> bool:
        with session_scope(self._sf) as s:
            if newest_profile(s, node_type) is not None:  # stored meanwhile (`lattice calibrate`)
                log.info("node type %s got a profile while calibrating; keeping that one", node_type)
            else:
                profile = save_profile(s, doc)
                meta = doc.get("meta") or {}
                log.info("node type %s: stored hardware profile v%d, measured on %s in %s s (the link to "
                         "another node: %s s; %s s in all)", node_type, profile.version, node.name,
                         meta.get("seconds"), meta.get("inter_node_s", "-"), meta.get("background_s"))
        with self._lock:
            self._profiled.add(node_type)
            if doc.get("inter_node"):
                self._linked.add(node_type)
        return True


def _pick_node(nodes: list[NodeInfo]) -> NodeInfo | None:
    """The schedulable node with the most free GPUs (the task holds one), or None."""
    usable = [n for n in nodes if n.schedulable and n.gpus_free >= 1]
    return max(usable, key=lambda n: n.gpus_free, default=None)


def from_settings(settings: Settings, session_factory: sessionmaker[Session],
                  read_session_factory: sessionmaker[Session]) -> AutoCalibrator:
    """The scheduler's calibrator: on unless LATTICE_AUTO_CALIBRATE=false."""
    return AutoCalibrator(session_factory, read_session_factory, settings.gpu_type,
                          enabled=settings.auto_calibrate)
