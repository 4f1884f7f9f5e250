"""Flight recorders on a hang (workers.collective_trace, training.parallel.dist): a real gloo group's
dump names its last collective, and the controller's hang event points at each rank's."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.collective_trace import annotate_hang, dump_path, read_last_collectives, trace_dir
from workers.controller.machine import ControllerStateMachine
from workers.controller.options import ControllerOptions
from workers.controller.state import ControllerState
from workers.policies import Failure, FailureKind
from workers.topology import Topology

from .dummy import DummyWorkerGroup, FakeClock, running


def _collectives_then_dump(rank: int, world: int, job_dir: str) -> str | None:
    import torch
    import torch.distributed as dist

    from training.parallel.dist import dump_flight_recorder

    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, src=0)
    return dump_flight_recorder(dump_path(job_dir, rank), "gloo")


def test_a_gloo_groups_flight_recorder_names_its_last_collective(tmp_path, monkeypatch) -> None:
    # The ring must be on before the group exists (the rank processes inherit the environment).
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    paths = run_ranks(2, _collectives_then_dump, args=(str(tmp_path),))
    assert paths == [str(dump_path(tmp_path, r)) for r in range(2)]
    last = read_last_collectives(tmp_path, range(3))  # rank 2 has no dump: left out
    assert sorted(last) == [0, 1]
    assert all(c["op"] == "gloo:broadcast" and c["seq"] == 2 for c in last.values()), last


def _dump(job_dir: Path, rank: int, entries: list[dict]) -> None:
    path = dump_path(job_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": "2.10", "entries": entries}))


def _entry(record: int, op: str, state: str) -> dict:
    return {"record_id": record, "collective_seq_id": record + 1, "profiling_name": op, "state": state,
            "process_group": ["0", "default_pg"], "is_p2p": False}


def test_annotate_hang_adds_each_ranks_last_collective_after_asking_for_dumps(tmp_path) -> None:
    failure = Failure(FailureKind.HANG, "no progress from rank(s) [1] for 70s (timeout 60s)", (1,),
                      evidence={"stale_ranks": [0, 1]})
    asked = []

    def dump() -> None:
        asked.append(True)
        _dump(tmp_path, 0, [_entry(0, "nccl:all_reduce", "completed"),
                            _entry(1, "nccl:all_reduce", "started")])
        _dump(tmp_path, 1, [_entry(0, "nccl:all_reduce", "completed")])

    _dump(tmp_path, 2, [_entry(0, "nccl:broadcast", "completed")])  # an earlier hang's: cleared
    out = annotate_hang(failure, str(tmp_path), range(3), dump)
    assert asked == [True]
    assert out.message.startswith(failure.message)
    assert "rank 0 nccl:all_reduce #2 (started), rank 1 nccl:all_reduce #1 (completed)" in out.message
    assert str(trace_dir(tmp_path)) in out.message
    rec = out.evidence["flight_recorder"]
    assert rec["files"] == ["rank-0.json", "rank-1.json"] and rec["last_collective"]["0"]["seq"] == 2
    assert out.evidence["stale_ranks"] == [0, 1]  # the detector's evidence is kept


def test_annotate_hang_leaves_the_failure_alone_without_dumps(tmp_path) -> None:
    failure = Failure(FailureKind.HANG, "hung", (0,))

    def broken() -> None:
        raise RuntimeError("rank actor gone")

    assert annotate_hang(failure, str(tmp_path), range(2), broken) == failure
    assert annotate_hang(failure, None, range(2)) == failure
    (trace_dir(tmp_path)).mkdir()
    (trace_dir(tmp_path) / "rank-0.json").write_text("not json")  # unreadable: pointed at, not parsed
    out = annotate_hang(failure, str(tmp_path), range(2))
    assert "last collectives" not in out.message
    assert out.evidence["flight_recorder"]["files"] == ["rank-0.json"]


class DumpingGroup(DummyWorkerGroup):
    """Its ranks write flight-recorder dumps when asked (as RankActor.dump_collectives does)."""

    def __init__(self, topology: Topology, job_dir: Path) -> None:
        super().__init__(topology)
        self.job_dir = job_dir
        self.dumps = 0

    def dump_collectives(self) -> None:
        self.dumps += 1
        for rank in range(4):
            state = "scheduled" if rank == 1 else "started"  # rank 1 never reached the all-reduce
            _dump(self.job_dir, rank, [_entry(6, "gloo:all_reduce", state)])


def test_the_controllers_hang_event_points_at_the_last_collective_of_each_rank(tmp_path) -> None:
    clock = FakeClock()
    wg = DumpingGroup(Topology.uniform(2, 2, 4), tmp_path)
    cfg = RunConfig(model=ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16), layout=Layout(dp=4),
                    steps=4, checkpoint=CheckpointConfig(dir=str(tmp_path), every_steps=2))
    sm = ControllerStateMachine("j1", cfg, wg, options=ControllerOptions(hang_timeout_s=60.0),
                                clock=clock, wall_clock=clock)
    for _ in range(10):
        if sm.state == ControllerState.RUNNING:
            break
        sm.step()
    wg.push(running(4, step={0: 3, 1: 2, 2: 3, 3: 3}, since_progress_s={0: 61.0, 1: 75.0, 2: 61.0, 3: 61.0}))
    assert sm.step().to_state == ControllerState.RECOVERING
    failure = [e for e in sm.events if e["kind"] == "failure"][0]["failure"]
    assert wg.dumps == 1 and failure["kind"] == "hang" and failure["ranks"] == [1]
    assert "rank 1 gloo:all_reduce #7 (scheduled)" in failure["message"]
    assert failure["evidence"]["flight_recorder"]["last_collective"]["0"]["state"] == "started"


def test_collective_timeout_outlasts_every_no_progress_limit() -> None:
    opts = ControllerOptions(hang_timeout_s=900.0, startup_timeout_s=300.0, checkpoint_timeout_s=600.0)
    assert opts.collective_timeout_s > 900.0
    assert ControllerOptions().collective_timeout_s > ControllerOptions().checkpoint_timeout_s


def test_flight_recorder_env_keeps_what_the_operator_set(tmp_path, monkeypatch) -> None:
    from training.parallel.dist import enable_flight_recorder, flight_recorder_env

    env = flight_recorder_env("/jobs/j1/flight_recorder/rank-")
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/jobs/j1/flight_recorder/rank-"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert "TORCH_FR_DUMP_TEMP_FILE" not in flight_recorder_env(None)
    for key in env:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "50")
    enable_flight_recorder(str(trace_dir(tmp_path) / "rank-"))
    import os

    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "50"  # the operator's value wins
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(trace_dir(tmp_path) / "rank-")
    assert trace_dir(tmp_path).is_dir()

