"""The replan after a node loss, when the new layout differs in more than the DP size: a
TP 2 x DP 2 job loses its node, the capacity left (2 GPUs) cannot hold it, and the service's
planner (PlannerReplanner) plans TP 1 x DP 2 with ZeRO-1 for the same global batch. The
controller re-plans, the engine reshards the verified checkpoint (DCP by FQN: TP shards ->
whole tensors, DDP optimizer state -> ZeRO-1 partitions), and the job finishes with parameters
allclose (1e-4) to a fault-free run in the original layout, every sample trained once, and the
events in order. Slow (`make test-faults`); the DP-only replan is in test_fault_matrix.py."""

from __future__ import annotations

import pytest
import torch

from tests.faults.harness import (
    SPEC,
    PlannerReplanner,
    assert_every_sample_once,
    assert_in_order,
    assert_kept_off,
    checkpoint_params,
    events,
    fault_free_params,
    job_cfg,
    options,
    run_job,
    wait_for_free_gpus,
)
from training.config.layout import Layout
from workers.placement import place, release, reserve
from workers.policies import ReplanPolicy
from workers.topology import Topology

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


def test_replan_to_another_tp_degree_and_zero_stage_keeps_the_global_batch_and_the_weights(
    tmp_path, revive_nodes
):
    layout = Layout(tp=2, dp=2)
    # The job may use r1-n1 (4 GPUs) and r1-n2, where a blocker leaves 2: a TP 2 x DP 2 job needs
    # r1-n1, and once r1-n1 is gone only 2 GPUs are left for it.
    blocker = reserve(place(Layout(dp=2), Topology.from_ray(cordoned=["r1-n1", "r2-n1", "r2-n2"])),
                      name="fm-replan-tp-blocker", timeout_s=30)
    try:
        cfg = job_cfg(str(tmp_path / "ckpt"), layout=layout)
        snap = run_job("fm-replan-tp", cfg, options({"kind": "kill_node", "node": "r1-n1", "at_step": 3}),
                       scaling_policy=ReplanPolicy(replanner=PlannerReplanner(SPEC)),
                       cordoned=["r2-n1", "r2-n2"])
    finally:
        release(blocker)
    assert snap["state"] == "FINISHED", (snap["reason"], [e["kind"] for e in snap["events"]])
    assert_in_order(snap, ["fault_injected", "failure", "node_dead", "restart", "replanned", "restore",
                           "resumed", "finished"])
    assert events(snap, "failure")[0]["failure"]["kind"] == "node_died"
    (replanned,) = events(snap, "replanned")
    assert replanned["diff"] == {"tp": [2, 1], "zero_stage": [0, 1]}
    assert replanned["global_batch_kept"] is True
    new = Layout.from_dict(replanned["new_layout"])
    assert (new.world_size, new.global_batch) == (2, layout.global_batch)
    assert snap["layout"] == snap["result"]["layout"] == new.to_dict()
    assert_kept_off(snap, "r1-n1", "node_dead")
    restore = events(snap, "restore")[0]
    assert restore["step"] == 2 and restore["step"] in snap["faults"]["verified_steps"]

    result = snap["result"]
    assert result["final_step"] == cfg.steps and result["resumed_from"] == 2
    assert_every_sample_once(result, cfg)  # the same global batch each step, in either layout
    final = checkpoint_params(tmp_path / "ckpt" / f"step-{cfg.steps}", tmp_path / "final.pt")
    ref = fault_free_params(cfg, tmp_path / "ref")
    assert final.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(final[name], value, atol=1e-4, rtol=1e-4)
