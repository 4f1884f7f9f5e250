"""A context-parallel job and an expert-parallel job through the whole service on the shared Ray
cluster: submitted over HTTP with explicit layouts (cp=2 and ep=2), placed with their CP and EP
groups on one node, trained, checkpointed, succeeded; the EP job's final weights equal the training
engine run directly with the same config."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from service.schemas import JobSpec
from tests.distributed import run_ranks
from tests.e2e.conftest import make_service, wait_for_free_gpus
from training.config.layout import Layout
from training.config.run import RunConfig
from workers.placement_axes import group_spread

pytestmark = pytest.mark.ray

TERMINAL = ("succeeded", "failed", "cancelled")
BASE: dict[str, Any] = {
    "data": {"kind": "synthetic", "seed": 0},
    "train": {"steps": 4, "global_batch": 4, "lr": 0.01, "seed": 0},
    "resources": {"gpus": 4},
    "checkpoint": {"every_steps": 2, "keep": 2},
}
CP_JOB: dict[str, Any] = {
    **BASE,
    "name": "e2e-cp2",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "seq_len": 32},
    "parallelism": {"cp": 2, "dp": 2, "micro_batch_size": 2},
}
EP_JOB: dict[str, Any] = {
    **BASE,
    "name": "e2e-ep2",
    "model": {
        "layers": 2,
        "hidden": 32,
        "heads": 4,
        "vocab": 64,
        "seq_len": 16,
        "num_experts": 4,
        "top_k": 2,
        "expert_ffn": 32,
    },
    "parallelism": {"dp": 4, "ep": 2, "zero_stage": 1},
}


@pytest.fixture(scope="module")
def jobs(ray_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict]]:
    """Both jobs submitted together (4 GPUs each of the cluster's 16) and run to the end."""
    wait_for_free_gpus()
    svc = make_service(ray_cluster, tmp_path_factory.mktemp("cpep") / "home")
    try:
        ids = {name: svc.submit(copy.deepcopy(spec))["id"] for name, spec in (("cp", CP_JOB), ("ep", EP_JOB))}
        yield {name: svc.wait_state(job_id, TERMINAL, timeout_s=300) for name, job_id in ids.items()}
    finally:
        svc.close()


def _spread(job: dict, axis: str) -> Any:
    layout = Layout.from_dict(job["plan"]["layout"])
    by_rank = sorted(job["placement"], key=lambda r: r["rank"])
    return group_spread(layout, [r["node_id"] for r in by_rank], [r["rack"] for r in by_rank], axis)


def _succeeded(job: dict) -> None:
    assert job["state"] == "succeeded", job["error"]
    result = job["result"]
    assert result["final_step"] == 4 and len(result["losses"]) == 4
    assert result["checkpoint"]["step"] == 4
    assert sorted(r["rank"] for r in job["placement"]) == [0, 1, 2, 3]


def test_context_parallel_job_succeeds_with_its_cp_groups_in_one_node(jobs: dict[str, dict]) -> None:
    job = jobs["cp"]
    _succeeded(job)
    assert job["plan"]["layout"]["cp"] == 2 and job["plan"]["comm_bytes_per_step"]["cp"] > 0
    assert _spread(job, "cp").max_nodes == 1
    assert job["result"]["loss_last"] < job["result"]["loss_first"]


def _direct_train(rank: int, world: int, cfg_dict: dict) -> str:
    import torch

    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return train(ctx, RunConfig.from_dict(cfg_dict), resume=False).model_digest


def test_expert_parallel_job_succeeds_and_matches_the_engine(jobs: dict[str, dict]) -> None:
    job = jobs["ep"]
    _succeeded(job)
    assert job["plan"]["layout"]["ep"] == 2 and job["plan"]["comm_bytes_per_step"]["ep"] > 0
    assert _spread(job, "ep").max_nodes == 1
    wait_for_free_gpus()
    cfg = JobSpec.model_validate(EP_JOB).to_run_config(Layout.from_dict(job["plan"]["layout"]), None)
    assert set(run_ranks(4, _direct_train, (cfg.to_dict(),))) == {job["result"]["model_digest"]}
