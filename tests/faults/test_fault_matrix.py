"""The seeded fault matrix (`make test-faults`): every fault kind x {early, mid-run,
during a checkpoint save}, a persistent bit flip with two replicas settled by a spare (same three
timings), plus the replicas' majority vote (DP 3), a harmful gradient bit flip
(exponent, > 2^10), a replan when a node's loss leaves too little capacity, and a spent restart
budget. The peer path (kill_rank, kill_node x the three timings, replicas on two nodes: 0 steps lost,
the fault-free digest) and DP 1 (the checkpoint, same timings) have their own cells. Killing the
service, at the same three timings, is test_service_kill_matrix.py; a replan
that changes the TP degree and the ZeRO stage is test_replan_layouts.py."""

from __future__ import annotations

import random

import pytest

from tests.faults.harness import (
    EVERY,
    assert_corruption_caught_before_restore,
    assert_in_order,
    assert_kept_off,
    assert_succeeded_like_fault_free,
    events,
    fault_free_digest,
    job_cfg,
    options,
    run_job,
    sdc_attribution,
    wait_for_free_gpus,
)
from training.config.layout import Layout
from workers.placement import place, release, reserve
from workers.policies import ReplanPolicy, RestartPolicy, keep_global_batch_replanner
from workers.topology import Topology

pytestmark = [pytest.mark.slow, pytest.mark.ray]

SEED = 6
TIMINGS = {"early": 1, "mid": 3, "checkpoint": EVERY}
KINDS = ("kill_rank", "kill_node", "hang_rank", "slow_rank", "bitflip", "corrupt_checkpoint")
CASES = [(k, t) for k in KINDS for t in TIMINGS]


def _fault(kind: str, timing: str, rng: random.Random) -> list[dict]:
    at = TIMINGS[timing]
    phase = {"phase": "checkpoint"} if timing == "checkpoint" and kind != "bitflip" else {}
    rank = rng.randrange(2)
    if kind == "bitflip":
        # Harmful: the top exponent bit of a weight (x 2^128) on one replica, or of a local gradient.
        target = "grad" if timing == "mid" else "param"
        return [{"kind": kind, "rank": rank, "at_step": max(at, 4 if target == "grad" else at),
                 "target": target, "bit": 30, "index": rng.randrange(1024)}]
    if kind == "corrupt_checkpoint":  # then a death, so that a restore has to skip it
        return [{"kind": kind, "at_step": max(at, EVERY)}, {"kind": "kill_rank", "rank": rank, "at_step": 5}]
    if kind == "slow_rank":
        return [{"kind": kind, "rank": rank, "at_step": at, "seconds": 1.0, **phase}]
    return [{"kind": kind, "rank": rank, "at_step": at, **phase}]


@pytest.fixture(autouse=True)
def _free_cluster(ray_cluster):
    wait_for_free_gpus(16)
    yield


@pytest.mark.parametrize(("kind", "timing"), CASES, ids=[f"{k}-{t}" for k, t in CASES])
def test_matrix(kind, timing, tmp_path, revive_nodes):
    rng = random.Random(f"{SEED}-{kind}-{timing}")
    faults = _fault(kind, timing, rng)
    # A straggler is named after straggler_steps late steps, seen by a controller that may lag a
    # loaded machine: two more steps keep a step to resume after the restore.
    cfg = job_cfg(str(tmp_path / "ckpt"), steps=8 if kind == "slow_rank" else 6)
    # quarantine_after=1, quarantine_jobs=1: in the matrix every culprit node is quarantined at its
    # first fault (the default ledger makes a node suspect, and quarantines it only on faults from
    # two jobs; a confirmed SDC quarantines it at once anyway).
    # A corrupt checkpoint matters only to the checkpoint path: the peer path is off for that kind.
    opts = options(*faults, straggler_steps=2, straggler_lag_s=0.5, quarantine_after=1, quarantine_jobs=1,
                   peer_recovery=kind != "corrupt_checkpoint")
    snap = run_job(f"fm-{kind}-{timing}".replace("_", "-"), cfg, opts)
    assert_succeeded_like_fault_free(snap, cfg)
    kept_off_after = "node_dead" if kind == "kill_node" else "node_quarantined"
    story = ["fault_injected", "failure", "attributed", kept_off_after, "restart", "restore", "resumed",
             "finished"]
    assert_in_order(snap, story)
    attributed = [e for e in events(snap, "attributed") if e.get("cause") != "checkpoint"][0]
    assert attributed["evidence"] is not None
    victim = faults[-1].get("rank")
    if kind not in ("kill_node",):
        assert attributed["ranks"] == [victim]
    culprit_node = attributed["nodes"][0]
    assert_kept_off(snap, culprit_node, kept_off_after)  # no rank placed there afterwards
    if kind != "kill_node":
        assert culprit_node in snap["quarantined_nodes"]
    if kind == "corrupt_checkpoint":
        damaged = next(e["step"] for e in events(snap, "fault_injected") if e.get("fault") == kind)
        assert_corruption_caught_before_restore(snap, damaged)
    restore = events(snap, "restore")[0]
    restart = events(snap, "restart")[0]
    # The culprit node keeps nothing of the job (dead, or quarantined: its survivors move too), so the
    # peer path needs a replica on another node; after corruption the peers are suspect anyway.
    before = events(snap, "started")[0]["placement"]
    replica_elsewhere = any(r["node_name"] != culprit_node for r in before)
    if kind in ("kill_rank", "kill_node", "hang_rank", "slow_rank") and replica_elsewhere:
        assert restart["path"] == "peer", restart  # nothing rolled back
        assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
        assert snap["faults"]["steps_lost"] == 0
    else:
        assert restart["path"] != "peer", restart
        if kind in ("kill_rank", "hang_rank", "slow_rank"):  # the survivor left the quarantined node
            assert restart["evicted"] == [1 - victim], restart
        assert restore["step"] in snap["faults"]["verified_steps"] or restore["step"] == 0
        assert restore["step"] not in snap["faults"]["corrupt_steps"]


@pytest.mark.parametrize("timing", list(TIMINGS))
def test_matrix_persistent_sdc_with_two_replicas_is_settled_by_a_spare(timing, tmp_path):
    """A faulty device (the flip recurs on the re-run): a spare replays the step and names it."""
    rng = random.Random(f"{SEED}-persistent-{timing}")
    victim = rng.randrange(2)
    flip = {"kind": "bitflip", "rank": victim, "at_step": TIMINGS[timing], "target": "param", "bit": 30,
            "index": rng.randrange(1024), "persistent": True}
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job(f"fm-persistent-{timing}", cfg, options(flip))
    assert_succeeded_like_fault_free(snap, cfg)
    assert_in_order(snap, ["fault_injected", "integrity_error", "failure", "referee_started", "referee",
                           "attributed", "node_quarantined", "restart", "restore", "resumed", "finished"])
    referee = events(snap, "referee")[0]["referee"]
    assert referee["culprits"] == [victim] and referee["healthy"] == [1 - victim]
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [victim] and snap["quarantined_nodes"] == attributed["nodes"]
    assert_kept_off(snap, attributed["nodes"][0], "node_quarantined")


def test_majority_vote_names_the_replica_with_dp3(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=3))
    snap = run_job("fm-vote", cfg, options({"kind": "bitflip", "rank": 2, "at_step": 3, "bit": 27}))
    assert_succeeded_like_fault_free(snap, cfg)
    attributed = sdc_attribution(snap)
    assert attributed["ranks"] == [2]
    assert attributed["evidence"]["evidence"]["ambiguous"] is False  # a strict majority, no re-run
    assert snap["quarantined_nodes"] == attributed["nodes"]


def test_a_budget_spent_fails_the_job_with_the_reason(tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"))
    kills = [{"kind": "kill_rank", "rank": r, "at_step": s} for r, s in ((1, 2), (0, 4))]
    snap = run_job("fm-budget", cfg, options(*kills), failure_policy=RestartPolicy(max_restarts=1))
    assert snap["state"] == "ERRORED"
    assert "restart budget spent (1 of max_restarts=1)" in snap["reason"]


def test_replan_keeps_the_global_batch_and_the_weights(tmp_path, revive_nodes):
    """Capacity short after a node death: DP 2 -> DP 1 with 2 micro-batches; weights allclose."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    topo = Topology.from_ray()
    blocker = reserve(place(Layout(dp=3), Topology.from_ray(cordoned=["r1-n1", "r2-n1", "r2-n2"])),
                      name="fm-replan-blocker", timeout_s=30)  # r1-n2 keeps one free GPU
    try:
        cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=2))
        snap = run_job("fm-replan", cfg, options({"kind": "kill_node", "rank": 0, "at_step": 3}),
                       scaling_policy=ReplanPolicy(replanner=keep_global_batch_replanner),
                       cordoned=["r2-n1", "r2-n2"])
    finally:
        release(blocker)
    assert topo.gpus_total == 16
    assert snap["state"] == "FINISHED", snap["reason"]
    replanned = events(snap, "replanned")[0]
    assert replanned["diff"] == {"dp": [2, 1], "num_microbatches": [1, 2]} and replanned["global_batch_kept"]
    assert_in_order(snap, ["fault_injected", "failure", "node_dead", "restart", "replanned", "restore",
                           "resumed", "finished"])
    final = torch.load(_to_torch(dcp_to_torch_save, tmp_path / "ckpt" / "step-6", tmp_path / "final.pt"))
    ref_dir = tmp_path / "ref"
    _reference(str(ref_dir), cfg.to_dict())
    ref = torch.load(_to_torch(dcp_to_torch_save, ref_dir / "step-6", tmp_path / "ref.pt"))
    for name, value in ref["model"].items():
        torch.testing.assert_close(final["model"][name], value, atol=1e-4, rtol=1e-4)
    assert fault_free_digest(cfg)  # the reference run itself is the fault-free one


def _to_torch(convert, ckpt, out):
    convert(str(ckpt), str(out))
    return str(out)


def _reference(ckpt_dir: str, cfg_dict: dict) -> None:
    from dataclasses import replace

    from tests.distributed import run_ranks
    from tests.faults.harness import _direct_digest
    from training.config.run import CheckpointConfig, RunConfig

    cfg = RunConfig.from_dict(cfg_dict)
    cfg = replace(cfg, checkpoint=CheckpointConfig(dir=ckpt_dir, every_steps=0))
    run_ranks(cfg.layout.world_size, _direct_digest, (cfg.to_dict(),))


# ---- the peer path: a lost rank with a healthy DP peer on another node; DP = 1 keeps the checkpoint ----
PEER_CASES = [(k, t) for k in ("kill_rank", "kill_node") for t in TIMINGS]


@pytest.fixture
def one_free_gpu_per_node():
    """Hold all but one GPU of every node, so that a DP 2 job puts its replicas on two nodes."""
    from ray.util.placement_group import placement_group

    from workers.placement import NODE_ID_LABEL

    nodes = Topology.from_ray(include_dead=False).gpu_nodes
    held = [n for n in nodes for _ in range(n.gpus_total - 1)]
    pg = placement_group([{"GPU": 1.0}] * len(held), strategy="PACK",
                         bundle_label_selector=[{NODE_ID_LABEL: n.node_id} for n in held])
    assert pg.wait(timeout_seconds=60)
    yield
    release(pg)


@pytest.mark.parametrize(("kind", "timing"), PEER_CASES, ids=[f"peer-{k}-{t}" for k, t in PEER_CASES])
def test_matrix_peer_path(kind, timing, tmp_path, revive_nodes, one_free_gpu_per_node):
    rng = random.Random(f"{SEED}-peer-{kind}-{timing}")
    faults = _fault(kind, timing, rng)
    cfg = job_cfg(str(tmp_path / "ckpt"))
    snap = run_job(f"fm-peer-{kind}-{timing}".replace("_", "-"), cfg, options(*faults))
    assert_succeeded_like_fault_free(snap, cfg)  # bit-identical to the fault-free run
    restart = events(snap, "restart")[0]
    assert restart["path"] == "peer", restart
    victim = faults[0]["rank"]
    assert restart["replaced"] == [victim] and restart["recovery"]["sources"] == {str(victim): 1 - victim}
    restore = events(snap, "restore")[0]
    assert (restore["source"], restore["steps_lost"]) == ("peers", 0)
    assert snap["faults"]["steps_lost"] == 0
    if kind == "kill_node":
        assert_kept_off(snap, events(snap, "fault_injected")[0]["node"], "node_dead")


@pytest.mark.parametrize("timing", list(TIMINGS))
def test_matrix_dp1_uses_the_checkpoint(timing, tmp_path):
    cfg = job_cfg(str(tmp_path / "ckpt"), layout=Layout(dp=1))
    fault = _fault("kill_rank", timing, random.Random(f"{SEED}-dp1-{timing}"))[0]
    snap = run_job(f"fm-dp1-{timing}", cfg, options({**fault, "rank": 0}))
    assert_succeeded_like_fault_free(snap, cfg)
    restart = events(snap, "restart")[0]
    assert restart["recovery"]["path"] == "checkpoint" and "no DP replica" in restart["recovery"]["why"]
    restore = events(snap, "restore")[0]  # before the first committed checkpoint: from scratch
    assert restore["source"] == ("checkpoint" if restore["step"] else "scratch")
    assert restore["step"] in snap["faults"]["verified_steps"] or restore["step"] == 0
