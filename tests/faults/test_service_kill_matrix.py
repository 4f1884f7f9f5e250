"""The "kill the service" row of the fault matrix: the real service (Runtime on a SQLite file,
scheduler and reconciler) runs a small job on the shared Ray cluster, real gloo ranks train it,
and the test stops the service at an exact point of the job (tests/faults/service_gate.py holds
every rank there): early (after step 1), mid-run (after step 3) or during a checkpoint save (the
save of step 4 has begun, nothing of it is written). Two flavours:

- reattach: the detached job controller survives; the job trains on while no service is up, and
  the next service re-attaches to it and stores what it missed, each event once;
- lost: the controller (and its ranks) dies with the service; the next service's reconciler
  recovers the job from its last checkpoint with a new controller.

Each job must succeed with the fault-free run's model_digest (the layout does not change), the
logged data positions (the `finished` event's data ledger) must show every sample trained on
exactly once, and the stored events must tell the story in order: everything up to the kill,
then `reattached` or `recover`, then the rest of the job to `finished`, no controller event
lost or stored twice. The six cases are slow (`make test-faults`); two of them (checkpoint x
reattach, mid x lost) also run in `make test`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray

from service import store
from service.schemas import JobSpec
from tests.e2e.conftest import LiveService, make_service, wait_for
from tests.faults.harness import (
    assert_every_sample_once,
    fault_free_digest,
    service_job_spec,
    wait_for_free_gpus,
)
from tests.faults.service_gate import TRAIN_FN, gate_env, held_ranks, release
from training.checkpoint.checkpointer import list_checkpoints
from training.config.layout import Layout
from training.config.run import RunConfig
from workers.controller import get_controller, kill_controller

pytestmark = pytest.mark.ray

SEED = 6
STEPS, EVERY, DP = 6, 2, 2
# Where the service dies: (gate phase, step), and the newest checkpoint stored by then.
TIMINGS: dict[str, tuple[str, int, int | None]] = {
    "early": ("step", 1, None),
    "mid": ("step", 3, 2),
    "checkpoint": ("checkpoint", 4, 2),
}
FLAVOURS = ("reattach", "lost")
CASES = [(t, f) for t in TIMINGS for f in FLAVOURS]
TERMINAL = ("succeeded", "failed", "cancelled")


def job_spec(name: str) -> dict[str, Any]:
    return service_job_spec(name, steps=STEPS, every=EVERY, seed=SEED, dp=DP)


def run_config(spec: dict[str, Any]) -> RunConfig:
    return JobSpec.model_validate(spec).to_run_config(Layout(dp=DP), None)


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster: Any) -> None:
    wait_for_free_gpus(16)


def _controller_seq(svc: LiveService, job_id: str) -> int:
    with svc.session() as s:
        return store.get_job(s, job_id).controller_seq


def _snapshot(job_id: str) -> dict[str, Any]:
    handle = get_controller(job_id)
    assert handle is not None, f"job {job_id} has no controller"
    return ray.get(handle.poll.remote(0), timeout=30)


def _held_and_stored(svc: LiveService, job_id: str, gate: Path, phase: str, step: int,
                     last_ckpt: int | None) -> dict[str, Any] | None:
    """The snapshot once every rank waits at the gate, the controller has heard all they reported
    and the service has stored all of it (nothing moves until the gate opens)."""
    if len(held_ranks(gate)) < DP:
        return None
    snap = _snapshot(job_id)
    p = snap["progress"]
    state = "CHECKPOINTING" if phase == "checkpoint" else "RUNNING"
    if (snap["state"], p["step"], p["last_checkpoint_step"]) != (state, step, last_ckpt):
        return None
    if _controller_seq(svc, job_id) != snap["last_seq"] or svc.job(job_id)["progress"]["step"] != step:
        return None
    return snap


def _wait_for_progress(job_id: str, phase: str, at: int, timeout_s: float = 120.0) -> None:
    """The job goes on past the gate with no service up (the held save commits, or a step is done)."""
    last: dict[str, Any] = {}

    def moved() -> bool:
        last.update(_snapshot(job_id))
        p = last["progress"]
        done = (p["last_checkpoint_step"] or 0) >= at if phase == "checkpoint" else p["step"] > at
        return bool(done or last["terminal"])

    try:
        wait_for(moved, timeout_s, "the job to go on while the service is down")
    except AssertionError as e:
        tail = [(ev["kind"], ev["message"]) for ev in last.get("events", [])[-8:]]
        raise AssertionError(f"{e}: {last.get('state')} {last.get('progress')} {tail}") from None


def run_service_kill(ray_cluster: Any, tmp_path: Path, timing: str, flavour: str) -> None:
    phase, at, last_ckpt = TIMINGS[timing]
    gate = tmp_path / "gate"
    spec = job_spec(f"sk-{timing}-{flavour}")
    cfg = run_config(spec)
    # The gate's hold must not look like a hang; the rest are the service's defaults.
    defaults = {"train_fn": TRAIN_FN, "env_vars": gate_env(gate, phase, at), "hang_timeout_s": 120.0,
                "poll_interval_s": 0.2}
    svc = make_service(ray_cluster, tmp_path / "home", controller_defaults=defaults)
    try:
        job_id = svc.submit(spec)["id"]
        snap = wait_for(lambda: _held_and_stored(svc, job_id, gate, phase, at, last_ckpt), 240,
                        f"every rank held at the {phase} gate of step {at}, all of it stored")
        before = svc.events(job_id)
        killed_at = {"cseq": snap["last_seq"], "events": len(before)}

        svc.stop()  # the service dies; the store keeps what it had written
        assert not _snapshot(job_id)["terminal"]
        if flavour == "reattach":
            release(gate)  # the job trains on with no service up
            _wait_for_progress(job_id, phase, at)
        else:
            assert kill_controller(job_id)  # its ranks and placement group go with it
            release(gate)  # the next attempt's ranks must not stop
            wait_for_free_gpus(16)
        svc.start()  # the reconciler: re-attach, or recover from the last checkpoint
        assert svc.runtime is not None and job_id in svc.runtime.scheduler.attached_jobs()
        job = svc.wait_state(job_id, TERMINAL, timeout_s=240)
        events = svc.events(job_id)
        with svc.session() as s:
            stored_ckpts = [c.step for c in store.list_checkpoints(s, job_id)]
        ckpt_root = svc.settings.checkpoint_root / job_id
    finally:
        release(gate)
        svc.close()

    # --- it succeeded with the fault-free run's weights -----------------------------------------
    assert job["state"] == "succeeded", (job["error"], [e["type"] for e in events])
    result = job["result"]
    assert result["final_step"] == STEPS
    assert result["model_digest"] == fault_free_digest(cfg)
    assert stored_ckpts == [2, 4, 6] and list_checkpoints(ckpt_root) == [2, 4, 6]

    # --- every sample once, as the controller's data ledger logged it ----------------------------
    (finished,) = [e for e in events if e["type"] == "finished"]
    logged = finished["payload"]["result"]
    assert_every_sample_once(logged, cfg)
    filled = logged["data_positions"]["filled_from_checkpoint"]

    # --- the story: up to the kill unchanged, then the reconciler, then the rest to the end -------
    types = [e["type"] for e in events]
    saved_at: dict[int, int] = {}  # checkpoint step -> index of its first stored event
    for i, e in enumerate(events):
        if e["type"] == "checkpoint":
            saved_at.setdefault(e["payload"]["step"], i)
    assert events[: killed_at["events"]] == before  # append-only across the restart
    assert types[killed_at["events"]] == ("reattached" if flavour == "reattach" else "recover")
    cseqs = [e["payload"]["cseq"] for e in events if "cseq" in e["payload"]]
    # Every controller event stored once and none lost: a committed checkpoint is stored as its
    # checkpoint row and `checkpoint` event (without a cseq), every other event under its own cseq.
    assert cseqs == sorted(set(cseqs)) and len(cseqs) + types.count("checkpoint") == cseqs[-1]
    upto = [e["payload"]["cseq"] for e in before if "cseq" in e["payload"]]
    later = [e["payload"]["cseq"] for e in events[killed_at["events"]:] if "cseq" in e["payload"]]
    assert upto[-1] <= killed_at["cseq"] < later[0]  # all it had said before the kill, stored before it
    moves = [e["payload"]["to"] for e in events if e["type"] == "state"]
    assert moves.count("succeeded") == 1 and moves[-1] == "succeeded"
    assert types.count("finished") == 1
    if flavour == "reattach":
        assert types.count("reattached") == 1 and "recover" not in types and "restart" not in types
        assert job["attempt"] == 0 and result["resumed_from"] is None
        assert filled == []  # one controller saw every step trained
        assert moves == ["queued", "starting", "running", "succeeded"]
        if phase == "checkpoint":  # the save held open at the kill committed while the service was down
            assert saved_at[at] > killed_at["events"]
    else:
        assert types.count("recover") == 1 and "reattached" not in types and "restart" not in types
        recover = events[killed_at["events"]]["payload"]
        assert recover["checkpoint_step"] == last_ckpt
        assert result["resumed_from"] == last_ckpt and job["attempt"] == 1
        # The steps up to the checkpoint were trained by the lost attempt (its ledger died with it)
        # and restored; every later step was logged by the new controller.
        assert filled == list(range(1, (last_ckpt or 0) + 1))
        story = types[killed_at["events"]:]
        assert story.index("recover") < story.index("started") < story.index("finished")
        assert moves[-3:] == ["recovering", "running", "succeeded"]
        if phase == "checkpoint":  # the save the kill interrupted is the new attempt's, not the old one's
            assert saved_at[at] > killed_at["events"] + story.index("started")


def test_service_killed_during_a_checkpoint_save_reattaches_and_the_job_finishes_like_fault_free(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """The re-attach flavour in `make test`; the full row is test_service_kill_matrix."""
    run_service_kill(ray_cluster, tmp_path, "checkpoint", "reattach")


def test_service_and_controller_lost_mid_run_the_job_recovers_from_its_checkpoint_like_fault_free(
    ray_cluster: Any, tmp_path: Path
) -> None:
    """The lost-controller flavour in `make test`: the reconciler's recovery from the last checkpoint."""
    run_service_kill(ray_cluster, tmp_path, "mid", "lost")


@pytest.mark.slow
@pytest.mark.parametrize(("timing", "flavour"), CASES, ids=[f"{t}-{f}" for t, f in CASES])
def test_service_kill_matrix(ray_cluster: Any, tmp_path: Path, timing: str, flavour: str) -> None:
    run_service_kill(ray_cluster, tmp_path, timing, flavour)
