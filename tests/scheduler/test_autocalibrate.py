"""Background calibration of new node types (service/scheduler/autocalibrate.py), without Ray: an
injected calibration stands in for the Ray task. Once per type without a profile, never for a type that
has one, never blocking the tick, retried with backoff after a failure, nothing unless leading
(SQLite and PostgreSQL, see tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.scheduler.autocalibrate import NODE_TYPE_LABEL, AutoCalibrator
from service.scheduler.leader import LeaderElector
from service.scheduler.loop import Scheduler
from service.settings import Settings
from service.store.db import make_session_factory
from service.store.profiles import newest_profile, newest_profiles, save_profile
from tests.control_plane.fakes import FakeWorkers
from workers.topology import Topology

WAIT_S = 30.0  # a functional bound on a background thread, never a measurement


def profile_doc(node_type: str, rate: float = 4e9) -> dict[str, Any]:
    return {"node_type": node_type, "compute_dtype": "fp32",
            "matmul": {"fp32": [[32, 32, 32, rate / 4], [128, 128, 128, rate]]}, "memory_bw": 8e9,
            "collectives": {"all_reduce": [[4096.0, 2e-4], [65536.0, 6e-4]]}, "backend": "gloo"}  # fmt: skip


INTER_NODE = {"all_reduce": [[4096.0, 4e-4], [4194304.0, 8e-3]]}


class FakeCalibration:
    """Records (node type, node id) calls; `gate` holds each one until set; `fail` calls raise first.
    `link` stands in for the inter-node measurement: records (node type, node, peer); raises when
    `link_fails`."""

    def __init__(self, fail: int = 0, gate: threading.Event | None = None, link_fails: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.links: list[tuple[str, str, str]] = []
        self.fail = fail
        self.gate = gate
        self.link_fails = link_fails

    def link(self, node_type: str, node_id: str, peer_id: str) -> Mapping[str, Any]:
        self.links.append((node_type, node_id, peer_id))
        if self.link_fails:
            raise RuntimeError("link measurement between nodes failed: the actor died")
        return {"backend": "gloo", "collectives": INTER_NODE}

    def __call__(self, node_type: str, node_id: str) -> Mapping[str, Any]:
        self.calls.append((node_type, node_id))
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("calibration of a node failed: the task died")
        return profile_doc(node_type)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_types(used: Mapping[str, int] | None = None) -> Topology:
    """r1-n1, r1-n2 unlabelled (the cluster's cpu-virtual); r2-n1, r2-n2 labelled H100."""
    topology = Topology.uniform(2, 2, 4, used=used)
    nodes = tuple(dataclasses.replace(n, labels={NODE_TYPE_LABEL: "h100"}) if n.rack == "r2" else n
                  for n in topology.nodes)  # fmt: skip
    return dataclasses.replace(topology, nodes=nodes)


def calibrator(sf: sessionmaker[Session], fake: FakeCalibration, **kw: Any) -> AutoCalibrator:
    return AutoCalibrator(sf, sf, "cpu-virtual", calibrate=fake, measure_link=fake.link, **kw)


def test_each_new_node_type_is_calibrated_once_in_the_background(
    db_session_factory: sessionmaker[Session],
) -> None:
    gate = threading.Event()
    fake = FakeCalibration(gate=gate)
    cal = calibrator(db_session_factory, fake)
    topology = two_types(used={"r1-n1": 4})
    assert sorted(cal.tick(topology)) == ["H100-80GB", "cpu-virtual"]  # returns with both still running
    assert cal.in_flight() == ["H100-80GB", "cpu-virtual"]
    assert cal.tick(topology) == []  # at most one in flight per type
    gate.set()
    assert cal.wait(WAIT_S)
    assert sorted(fake.calls) == [("H100-80GB", "r2-n1"), ("cpu-virtual", "r1-n2")]  # r1-n1 has no free GPU
    with db_session_factory() as s:
        stored = newest_profiles(s)
    assert {t: p.version for t, p in stored.items()} == {"H100-80GB": 1, "cpu-virtual": 1}
    # H100 has two free nodes: the link between them is timed, the inter-node tier of its profile;
    # cpu-virtual's other node is full, so its profile keeps the catalogue's inter-node link.
    assert fake.links == [("H100-80GB", "r2-n1", "r2-n2")]
    assert stored["H100-80GB"].inter_node == {"all_reduce": [(4096.0, 4e-4), (4194304.0, 8e-3)]}
    assert stored["cpu-virtual"].inter_node == {}
    # How long each took (the bound is on the whole background calibration of a type).
    h100, cpu = stored["H100-80GB"].meta, stored["cpu-virtual"].meta
    assert {"background_s", "inter_node_s"} <= set(h100) and h100["background_s"] >= h100["inter_node_s"]
    assert "background_s" in cpu and "inter_node_s" not in cpu
    for _ in range(3):
        assert cal.tick(topology) == []
    assert len(fake.calls) == 2 and cal.in_flight() == []


def test_a_type_with_a_profile_is_not_calibrated(db_session_factory: sessionmaker[Session]) -> None:
    with db_session_factory() as s:
        save_profile(s, profile_doc("cpu-virtual"))
        s.commit()
    fake = FakeCalibration()
    cal = calibrator(db_session_factory, fake)
    assert cal.tick(Topology.uniform(1, 1, 4)) == []  # one node: no link to time either
    assert fake.calls == [] and fake.links == []
    assert not calibrator(db_session_factory, fake, enabled=False).tick(two_types())  # the setting off
    assert fake.calls == [] and fake.links == []


def test_a_profile_without_the_inter_node_tier_gets_the_link_timed_when_a_second_node_joins(
    db_session_factory: sessionmaker[Session],
) -> None:
    with db_session_factory() as s:
        first = save_profile(s, profile_doc("cpu-virtual"))  # calibrated on a one-node cluster
        s.commit()
    fake = FakeCalibration()
    cal = calibrator(db_session_factory, fake)
    assert cal.tick(Topology.uniform(1, 1, 4)) == [] and fake.links == []
    assert cal.tick(Topology.uniform(1, 2, 4, used={"r1-n2": 4})) == []  # the second node is full
    assert cal.tick(Topology.uniform(1, 2, 4)) == ["cpu-virtual"] and cal.wait(WAIT_S)
    assert fake.calls == [] and fake.links == [("cpu-virtual", "r1-n1", "r1-n2")]  # the link alone
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
        # `lattice calibrate` (one machine, no link) keeps the measured tier in its next version
        again = save_profile(s, profile_doc("cpu-virtual", rate=9e9))
    assert stored is not None and stored.version == 2 and stored.inter_node == {"all_reduce": [
        (4096.0, 4e-4), (4194304.0, 8e-3)]}
    assert stored.matmul == first.matmul and stored.collectives == first.collectives  # the rest kept
    assert again.version == 3 and again.inter_node == stored.inter_node and again.matmul != first.matmul
    for _ in range(3):
        assert cal.tick(Topology.uniform(1, 2, 4)) == []
    assert len(fake.links) == 1


def test_no_free_gpu_or_an_unknown_type_waits_without_counting_a_failure(
    db_session_factory: sessionmaker[Session],
) -> None:
    fake = FakeCalibration()
    cal = calibrator(db_session_factory, fake)
    busy = Topology.uniform(1, 2, 4, used={"r1-n1": 4, "r1-n2": 4})
    unknown = dataclasses.replace(busy, nodes=tuple(dataclasses.replace(n, labels={NODE_TYPE_LABEL: "tpu-v9"})
                                                     for n in Topology.uniform(1, 1, 4).nodes))  # fmt: skip
    assert cal.tick(busy) == [] and cal.tick(unknown) == [] and fake.calls == []
    assert cal.tick(Topology.uniform(1, 2, 4, used={"r1-n1": 4})) == ["cpu-virtual"]  # a GPU came free
    assert cal.wait(WAIT_S) and fake.calls == [("cpu-virtual", "r1-n2")]


def test_a_failing_link_measurement_stores_the_profile_without_the_inter_node_tier(
    db_session_factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    fake, clock = FakeCalibration(link_fails=True), Clock()
    cal = calibrator(db_session_factory, fake, backoff_s=30.0, clock=clock)
    two = Topology.uniform(1, 2, 4)
    assert cal.tick(two) == ["cpu-virtual"] and cal.wait(WAIT_S)
    assert fake.links == [("cpu-virtual", "r1-n1", "r1-n2")]
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 1 and stored.inter_node == {}
    assert stored.collectives["all_reduce"]  # the node's own measurements are kept
    assert "catalogue's inter-node link" in caplog.text
    # The link alone is tried again on the next tick; its failure backs off like a calibration's.
    assert cal.tick(two) == ["cpu-virtual"] and cal.wait(WAIT_S) and len(fake.links) == 2
    assert cal.tick(two) == [] and len(fake.calls) == 1
    clock.now += 30.0
    fake.link_fails = False
    assert cal.tick(two) == ["cpu-virtual"] and cal.wait(WAIT_S) and len(fake.calls) == 1
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 2 and stored.inter_node["all_reduce"]


def test_a_failing_calibration_is_retried_with_backoff_and_never_raises(
    db_session_factory: sessionmaker[Session],
) -> None:
    clock = Clock()
    fake = FakeCalibration(fail=2)
    cal = calibrator(db_session_factory, fake, backoff_s=30.0, clock=clock)
    topology = Topology.uniform(1, 2, 4)

    def attempt() -> list[str]:
        started = cal.tick(topology)
        assert cal.wait(WAIT_S)
        return started

    assert attempt() == ["cpu-virtual"]  # fails (logged, not raised)
    assert attempt() == []  # backing off
    clock.now += 30.0
    assert attempt() == ["cpu-virtual"]  # fails again: the backoff doubles
    clock.now += 30.0
    assert attempt() == []
    clock.now += 30.0
    assert attempt() == ["cpu-virtual"]  # succeeds
    assert len(fake.calls) == 3
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 1
    clock.now += 3600.0
    assert attempt() == [] and len(fake.calls) == 3


def test_a_profile_stored_meanwhile_wins(db_session_factory: sessionmaker[Session]) -> None:
    gate = threading.Event()
    cal = calibrator(db_session_factory, FakeCalibration(gate=gate))
    assert cal.tick(Topology.uniform(1, 1, 4)) == ["cpu-virtual"]
    with db_session_factory() as s:  # an operator's `lattice calibrate` (the full grid) lands first
        save_profile(s, profile_doc("cpu-virtual", rate=9e9))
        s.commit()
    gate.set()
    assert cal.wait(WAIT_S)
    with db_session_factory() as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 1 and stored.matmul["fp32"][-1][3] == 9e9


def _elector(engine: Engine, holder: str) -> LeaderElector:
    return LeaderElector(engine, holder=holder, lease_s=1.5, renew_s=0.3)


def _lead(elector: LeaderElector) -> int:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if (term := elector.step()) is not None:
            return term
        time.sleep(0.15)
    raise AssertionError(f"{elector.holder} did not take the lease")


def _scheduler(engine: Engine, holder: str, home: Path, fake: FakeCalibration,
               clock: Clock) -> tuple[Scheduler, LeaderElector]:
    elector = _elector(engine, holder)
    sf, rsf = elector.session_factory(engine), make_session_factory(engine, read_only=True)
    settings = Settings(home=home, gpu_type="cpu-virtual", auto_calibrate=True)
    cal = AutoCalibrator(sf, rsf, settings.gpu_type, calibrate=fake, measure_link=fake.link, backoff_s=30.0,
                         clock=clock)
    return Scheduler(settings, sf, read_session_factory=rsf, leader=elector, calibrator=cal), elector


def test_only_the_leading_scheduler_calibrates_and_a_failure_never_stops_its_loop(
    db_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeWorkers().install(monkeypatch)  # the fake Ray side: a 2 x 2 x 4 cpu-virtual cluster
    fa, fb, clock = FakeCalibration(fail=1), FakeCalibration(), Clock()
    a, ea = _scheduler(db_engine, "host-a:1", tmp_path / "a", fa, clock)
    b, eb = _scheduler(db_engine, "host-b:2", tmp_path / "b", fb, clock)
    assert ea.step() == 1 and eb.step() is None
    for _ in range(3):
        assert a.step() is True  # the first calibration fails in the background; the loop goes on
        assert a.calibrator.wait(WAIT_S)
        assert b.step() is False
    assert [t for t, _ in fa.calls] == ["cpu-virtual"] and fb.calls == []  # backing off after the failure
    with Session(db_engine) as s:
        assert newest_profile(s, "cpu-virtual") is None
    clock.now += 30.0  # the backoff has passed: the leader tries again, and stores version 1
    assert a.step() is True and a.calibrator.wait(WAIT_S) and b.step() is False
    assert len(fa.calls) == 2 and fb.calls == []
    with Session(db_engine) as s:
        stored = newest_profile(s, "cpu-virtual")
    assert stored is not None and stored.version == 1


def test_a_deposed_leaders_calibration_is_refused_by_the_fence(
    db_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="service.scheduler.autocalibrate")
    a, b = _elector(db_engine, "host-a:1"), _elector(db_engine, "host-b:2")
    assert _lead(a) == 1
    gate = threading.Event()
    fake = FakeCalibration(gate=gate)
    sf = a.session_factory(db_engine)
    cal = AutoCalibrator(sf, sf, "cpu-virtual", calibrate=fake, measure_link=fake.link)
    assert cal.tick(Topology.uniform(1, 1, 4)) == ["cpu-virtual"]
    assert _lead(b) == 2  # a stopped renewing while its calibration ran
    gate.set()
    assert cal.wait(WAIT_S)
    with Session(db_engine) as s:
        assert newest_profile(s, "cpu-virtual") is None  # the late write was refused
    assert "no longer leads" in caplog.text and "failed" not in caplog.text  # not a failure to retry


def test_the_setting_is_on_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LATTICE_AUTO_CALIBRATE", raising=False)
    assert Settings(home=tmp_path).auto_calibrate is True
    monkeypatch.setenv("LATTICE_AUTO_CALIBRATE", "false")
    assert Settings(home=tmp_path).auto_calibrate is False


def _pending_demo(engine: Engine, home: Path) -> str:
    """A demo job as the API stores it while the cluster has no profile: planned from the catalogue."""
    from service import store
    from service.api.operations import plan_job
    from service.schemas import JobSpec

    spec = JobSpec.model_validate({"name": "demo", "model": {"preset": "demo"},
                                   "train": {"steps": 4, "global_batch": 8}, "parallelism": "auto"})
    plan = plan_job(spec, Settings(home=home, gpu_type="cpu-virtual"))
    assert plan["profile"] is None
    with Session(engine) as s:
        store.ensure_tenant(s, "default")
        job_id = store.create_job(s, tenant="default", name="demo", spec=spec.model_dump(mode="json"),
                                  plan=plan).id
        s.commit()
    return job_id


def _job(engine: Engine, job_id: str) -> tuple[str, str, dict[str, Any], list[dict[str, Any]]]:
    from service import store

    with Session(engine) as s:
        job = store.get_job(s, job_id)
        events = [{"type": e.type, **e.payload} for e in store.list_events(s, job_id, limit=None)]
        return job.state, job.reason or "", dict(job.plan or {}), events


def _held(engine: Engine, home: Path, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[Scheduler, LeaderElector, threading.Event, Clock, str]:
    """A leading scheduler whose calibration waits for `gate`, and a demo job planned from the catalogue."""
    FakeWorkers().install(monkeypatch)
    gate, clock = threading.Event(), Clock()
    sched, elector = _scheduler(engine, "host-a:1", home, FakeCalibration(gate=gate), clock)
    job_id = _pending_demo(engine, home)
    assert elector.step() == 1
    return sched, elector, gate, clock, job_id


def test_jobs_wait_for_the_first_profile_and_are_planned_with_it(
    db_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched, elector, gate, clock, job_id = _held(db_engine, tmp_path, monkeypatch)
    for _ in range(2):  # the calibration starts, and the job waits for it (said once)
        clock.now += 10.0
        assert sched.step() is True
    state, reason, plan, events = _job(db_engine, job_id)
    assert state == "pending" and plan["profile"] is None
    assert reason.startswith("pending: waiting for the cpu-virtual nodes' first hardware profile"), reason
    assert [e["type"] for e in events].count("waiting") == 1
    gate.set()
    assert sched.calibrator.wait(WAIT_S)
    assert sched.step() is True
    state, _, plan, events = _job(db_engine, job_id)
    assert state != "pending" and plan["profile"] == {"node_type": "cpu-virtual", "version": 1}
    (replanned,) = [e for e in events if e["type"] == "plan"]
    assert "measured hardware profile v1" in replanned["reason"]
    assert plan["checkpoint"]["every_steps"] >= 1  # the period is shown with the new plan, as at submit


def test_the_wait_for_a_profile_is_bounded(
    db_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched, elector, gate, clock, job_id = _held(db_engine, tmp_path, monkeypatch)
    assert sched.step() is True
    assert _job(db_engine, job_id)[0] == "pending"
    clock.now += sched.settings.calibration_hold_s  # still calibrating: planned from the catalogue now
    assert sched.step() is True
    state, _, plan, _ = _job(db_engine, job_id)
    assert state != "pending" and plan["profile"] is None
    gate.set()
    assert sched.calibrator.wait(WAIT_S)
