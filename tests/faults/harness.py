"""Drive one job with injected faults through a real controller on the shared Ray cluster and
check the fault-tolerance guarantees: it succeeds, its weights equal a fault-free run's (allclose after
a replan), no sample is skipped or repeated, the culprit node is kept out, and the events tell the
story in order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec
from workers.controller import ControllerOptions, kill_controller, start_controller
from workers.topology import Topology

SPEC = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
STEPS = 6
EVERY = 2
_baselines: dict[str, str] = {}


def job_cfg(ckpt_dir: str, layout: Layout | None = None, steps: int = STEPS, every: int = EVERY) -> RunConfig:
    return RunConfig(model=SPEC, layout=layout or Layout(dp=2), steps=steps,
                     checkpoint=CheckpointConfig(dir=ckpt_dir, every_steps=every))


def service_job_spec(name: str, *, steps: int, every: int, seed: int, dp: int = 2) -> dict[str, Any]:
    """The API spec of a tiny seeded DP job, for the tests that drive a real service."""
    return {
        "name": name,
        "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16},
        "data": {"kind": "synthetic", "seed": seed},
        "train": {"steps": steps, "global_batch": dp, "lr": 0.003, "seed": seed},
        "parallelism": {"dp": dp},
        "resources": {"gpus": dp},
        "checkpoint": {"every_steps": every, "keep": 3},
    }


def options(*faults: dict[str, Any], **kw: Any) -> ControllerOptions:
    base = {"poll_interval_s": 0.2, "hang_timeout_s": 4.0, "startup_timeout_s": 120.0,
            "failure_grace_s": 3.0, "rank_poll_timeout_s": 5.0, "checkpoint_timeout_s": 8.0}
    return ControllerOptions(faults=tuple(faults), **{**base, **kw})


def _direct_digest(rank: int, world: int, cfg_dict: dict) -> str:
    import torch

    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return train(ctx, RunConfig.from_dict(cfg_dict), resume=False).model_digest


def fault_free_digest(cfg: RunConfig) -> str:
    """The digest of the same job without faults (no checkpoints: they do not change the maths)."""
    clean = replace(cfg, checkpoint=CheckpointConfig())
    key = repr(clean.to_dict())
    if key not in _baselines:
        digests = run_ranks(cfg.layout.world_size, _direct_digest, (clean.to_dict(),))
        assert len(set(digests)) == 1
        _baselines[key] = digests[0]
    return _baselines[key]


def wait_for_free_gpus(n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while Topology.from_ray().gpus_free < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {n} free GPUs")
        time.sleep(0.2)


def run_job(job_id: str, cfg: RunConfig, opts: ControllerOptions, timeout_s: float = 180.0,
            **controller_kw: Any) -> dict[str, Any]:
    """Run the job to a terminal state; returns the final snapshot with every event."""
    handle = start_controller(job_id, cfg, options=opts, **controller_kw)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                snap = ray.get(handle.poll.remote(0), timeout=30)
            except ray.exceptions.ActorUnavailableError:  # transient while a node is being removed
                time.sleep(0.5)
                continue
            if snap["terminal"]:
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not done after {timeout_s:.0f}s: {snap['state']} "
                                     f"{[e['kind'] for e in snap['events']][-15:]}")
            time.sleep(0.3)
    finally:
        kill_controller(job_id)


def kinds(snap: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in snap["events"]]


def events(snap: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in snap["events"] if e["kind"] == kind]


def sdc_attribution(snap: dict[str, Any]) -> dict[str, Any]:
    """The attribution of the silent data corruption (a loaded machine may first attribute a slow
    rank's hang or straggling, which is another, infrastructure, fault)."""
    return next(e for e in events(snap, "attributed") if e["cause"] == "sdc")


def assert_in_order(snap: dict[str, Any], story: Sequence[str]) -> None:
    """Each kind of `story` occurs after the previous one (first occurrence after it)."""
    seq = kinds(snap)
    at = -1
    for kind in story:
        later = [i for i, k in enumerate(seq) if k == kind and i > at]
        assert later, f"no {kind!r} after position {at} in {seq}"
        at = later[0]


def assert_succeeded_like_fault_free(snap: dict[str, Any], cfg: RunConfig) -> None:
    assert snap["state"] == "FINISHED", (snap["reason"], kinds(snap))
    result = snap["result"]
    assert result["final_step"] == cfg.steps
    assert result["model_digest"] == fault_free_digest(cfg)
    assert_every_sample_once(result, cfg)


def assert_every_sample_once(result: dict[str, Any], cfg: RunConfig) -> None:
    """The steps that count trained on exactly the fault-free run's samples, each once."""
    from training.data.sources import make_data_source

    data = result["data_positions"]
    assert data["steps"] == list(range(1, cfg.steps + 1))
    assert data["repeated"] == 0 and data["skipped"] == 0
    source = make_data_source(cfg.data, cfg.model, cfg.global_batch)
    expected = [source.positions(step, 0, 1) for step in data["steps"]]
    assert data["by_step"] == expected
    flat = [p for step in data["by_step"] for p in step]
    assert len(flat) == len(set(flat)) == cfg.steps * cfg.global_batch


def assert_kept_off(snap: dict[str, Any], node: str, after_kind: str) -> None:
    """No rank was placed on `node` after the first `after_kind` event."""
    seq = snap["events"]
    start = next(i for i, e in enumerate(seq) if e["kind"] == after_kind)
    for e in seq[start:]:
        for r in e.get("placement") or []:
            assert r["node_name"] != node, f"rank {r['rank']} on {node} after {after_kind}: {e['kind']}"
    assert node not in {r["node_name"] for r in snap["placement"]}


def assert_corruption_caught_before_restore(snap: dict[str, Any], damaged_step: int) -> None:
    """The damaged checkpoint was found by manifest verification (at its commit, or by the scrub
    before the restart when the rank that died never reported the save) and was not restored."""
    seq = snap["events"]
    caught = next(i for i, e in enumerate(seq) if e["kind"] == "failure"
                  and e["failure"]["kind"] == "checkpoint")
    restore = next(i for i, e in enumerate(seq) if e["kind"] == "restore")
    injected = next(i for i, e in enumerate(seq) if e["kind"] == "fault_injected"
                    and e.get("fault") == "corrupt_checkpoint")
    assert injected < caught < restore
    assert seq[caught]["detected_by"] == "manifest verification"
    assert seq[caught]["failure"]["step"] == damaged_step
    assert damaged_step in snap["faults"]["corrupt_steps"]
    assert seq[restore]["step"] != damaged_step



# ---- replanning -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannerReplanner:
    """The service's planner as a workers.policies.Replanner: the planned layout (any TP / PP / DP /
    ZeRO choice) for the most schedulable GPUs left, below the current world size, with the same
    global batch and so the same training mathematics. The cluster is described as the service
    describes it (service.scheduler.admission.plan_for_live_cluster)."""

    model: ModelSpec
    gpu_type: str = "cpu-virtual"

    def __call__(self, topology: Topology, layout: Layout) -> Layout | None:
        from service.planner import ClusterSpec, PlannerError, TrainSpec, plan

        per_rack = max((len(nodes) for nodes in topology.racks.values()), default=1)
        train = TrainSpec(global_batch=layout.global_batch, seq_len=self.model.seq_len)
        for gpus in range(min(topology.gpus_schedulable, layout.world_size - 1), 0, -1):
            cluster = ClusterSpec(gpu_type=self.gpu_type, num_gpus=gpus,
                                  gpus_per_node=topology.gpus_per_node() or 1, nodes_per_rack=per_rack)
            try:
                return plan(self.model, train, cluster).layout
            except PlannerError:
                continue
        return None


def checkpoint_params(step_dir: Path, out: Path) -> dict[str, Any]:
    """The full (unsharded) model parameters of a DCP checkpoint, whatever layout wrote it."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(str(out))["model"]


def fault_free_params(cfg: RunConfig, work: Path) -> dict[str, Any]:
    """The final parameters of the same job run directly on gloo ranks, without faults, in its
    original layout (one checkpoint, at the end)."""
    clean = replace(cfg, checkpoint=CheckpointConfig(dir=str(work / "ckpt"), every_steps=0))
    run_ranks(clean.layout.world_size, _direct_digest, (clean.to_dict(),))
    return checkpoint_params(work / "ckpt" / f"step-{cfg.steps}", work / "fault-free.pt")
