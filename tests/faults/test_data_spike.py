"""A clean job's own gradient spike, end to end on the embedded cluster (real Ray actors, gloo ranks,
the controller). bench.recovery's job under ZeRO-1 (no pre-step snapshot to re-run a step from):
at step 295 of a fault-free run, rank 0's local gradient norm is 16x its history — the data's. It
used to fail the job ("again after the restart": job error), then to cost a restart from the last
checkpoint (the restart re-ran the step). Now the step is re-run before its optimizer step
(training.integrity.before_update): the same norm, and the same on the DP peer's device, is the
data's; no attempt fails, no step is lost, and the job finishes with the weights of a run without
the checks."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks
from tests.faults.harness import events, kinds, options, run_job, wait_for_free_gpus
from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec

pytestmark = pytest.mark.ray

SPEC = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32)  # bench.recovery's
STEPS, SPIKE = 300, 295


def _cfg(ckpt: str | None) -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(dp=2, micro_batch_size=2, zero_stage=1), steps=STEPS,
                     checkpoint=CheckpointConfig(dir=ckpt, every_steps=5 if ckpt else 0))


def _unchecked_digest(rank: int, world: int) -> str:
    import torch

    from training.hooks import TrainHooks
    from training.parallel.dist import DistContext
    from training.train import train

    hooks = TrainHooks()
    hooks.audit = None  # no gradient checks: the checks read the gradients, never change them
    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return train(ctx, _cfg(None), hooks, resume=False).model_digest


def test_a_jobs_own_gradient_spike_is_re_run_before_the_update_and_the_job_finishes(ray_cluster, tmp_path):
    wait_for_free_gpus(2)
    snap = run_job("data-spike-zero1", _cfg(str(tmp_path / "ckpt")), options(), timeout_s=400)
    assert snap["state"] == "FINISHED", (snap["reason"], kinds(snap)[-12:])
    assert not {"failure", "restart", "restore"} & set(kinds(snap)), kinds(snap)
    [spike] = events(snap, "gradient_spike")
    assert spike["step"] == SPIKE and spike["ranks"] == [0], spike
    ev = spike["evidence"]
    assert ev["attribution"] == "re-run before the update" and ev["local_reproduced"] is True, ev
    assert ev["swap"]["follows_data"] is True, ev  # the batch gave the same norm on the DP peer's device
    assert not {"attributed", "node_suspect", "node_quarantined", "job_error"} & set(kinds(snap))
    assert snap["result"]["model_digest"] == run_ranks(2, _unchecked_digest)[0]
