"""Pure fault-tolerance bookkeeping, without Ray: fault specs, the node and checkpoint ledgers, the data
ledger, straggler detection, policy decisions and the replanner that keeps the global batch."""

from __future__ import annotations

import pytest

from training.config.layout import Layout
from workers.fault_ledger import CheckpointLedger, DataLedger, FaultClock, NodeLedger, StragglerWatch
from workers.faults import FaultError, normalize_fault, normalize_faults
from workers.policies import (
    Failure,
    FailureKind,
    ReplanPolicy,
    RestartPolicy,
    ScalingAction,
    keep_global_batch_replanner,
)
from workers.topology import Topology


def test_fault_specs_are_validated_with_the_field_named():
    assert normalize_fault({"kind": "bitflip", "rank": 1, "at_step": 3}) == {
        "kind": "bitflip", "rank": 1, "at_step": 3, "phase": "step", "target": "param",
        "name": "layers.0.attention.wq.weight", "index": 0, "bit": 30, "persistent": False}
    assert normalize_fault({"kind": "slow_rank", "rank": 0, "at_step": 1})["seconds"] == 1.0
    for bad, field in [({"kind": "melt", "at_step": 1}, "kind"),
                       ({"kind": "kill_rank", "at_step": 1}, "rank"),
                       ({"kind": "kill_node", "at_step": 1}, "node"),
                       ({"kind": "bitflip", "rank": 0, "at_step": 1, "bit": 64}, "bit"),
                       ({"kind": "bitflip", "rank": 0, "at_step": 1, "persistent": "yes"}, "persistent"),
                       ({"kind": "hang_rank", "rank": 0, "at_step": 1, "phase": "lunch"}, "phase"),
                       ({"kind": "corrupt_checkpoint", "at_step": 1, "which": "../x"}, "which")]:
        with pytest.raises(FaultError, match=field):
            normalize_fault(bad)
    with pytest.raises(FaultError, match=r"faults\[1\]\.at_step"):
        normalize_faults([{"kind": "kill_rank", "rank": 0, "at_step": 1}, {"kind": "kill_rank", "rank": 0}])


def test_node_ledger_suspect_then_quarantined_after_n_faults_from_two_jobs_or_a_confirmed_sdc():
    ledger = NodeLedger(quarantine_after=2)
    assert ledger.record("a", job="j1") == "suspect"
    for _ in range(5):  # one job's faults never quarantine a node under the default ledger
        assert ledger.record("a", job="j1") is None
    assert ledger.health["a"] == "suspect" and ledger.fault_jobs["a"] == {"j1"}
    assert ledger.record("a", job="j2") == "quarantined"  # a second job's fault: two jobs saw it
    assert ledger.record("a", job="j3") is None  # stays quarantined
    assert ledger.record("b", job="j1", quarantine=True) == "quarantined"  # a confirmed SDC: at once
    assert ledger.record("c", job="j1", dead=True) == "dead"
    assert ledger.in_state("quarantined") == {"a", "b"}


def test_node_ledger_with_one_job_allowed_quarantines_on_the_count_alone():
    ledger = NodeLedger(quarantine_after=2, min_jobs=1)
    assert ledger.record("a", job="j1") == "suspect"
    assert ledger.record("a", job="j1") == "quarantined"


def test_checkpoint_ledger_restores_only_verified_undamaged_steps_and_persists(tmp_path):
    ledger = CheckpointLedger(str(tmp_path))
    assert ledger.restore_steps() is None  # no ledger yet: any valid checkpoint
    for step in (2, 4):
        ledger.mark_verified(step)
        ledger.committed[step] = f"{tmp_path}/step-{step}"
    ledger.committed[6] = f"{tmp_path}/step-6"  # committed, never verified
    ledger.mark_corrupt(4, "file x is damaged")
    assert ledger.restore_steps() == {2} and ledger.expected_restore() == 2
    again = CheckpointLedger(str(tmp_path))
    again.load()
    assert again.restore_steps() == {2} and again.corrupt == {4: "file x is damaged"}


def test_data_ledger_rolls_back_restored_steps_and_fills_lost_reports():
    data = DataLedger()
    for step in (1, 2, 3):
        data.record(step, [2 * step], 0.1, dp_rank=0)
    data.record(1, [3], 0.1, dp_rank=1)  # rank 1's reports of steps 2 and 3 died with it
    assert data.rollback(2) == 1 and sorted(data.by_step) == [1, 2]
    assert data.fill(2, 2, lambda s, r: [2 * s + r]) == [2]
    summary = data.summary()
    assert summary["by_step"] == [[2, 3], [4, 5]] and summary["repeated"] == summary["skipped"] == 0
    assert summary["filled_from_checkpoint"] == [2]


def test_straggler_needs_the_same_rank_last_by_the_threshold_several_steps_running():
    watch = StragglerWatch(min_lag_s=0.5, factor=2.0, steps=2)
    watch.reset(world=2)
    watch.step_times = [0.1] * 5
    assert watch.arrive(1, 0, 10.0) is None and watch.arrive(1, 1, 10.8) is None
    assert watch.arrive(2, 1, 11.0) is None and watch.arrive(2, 0, 11.1) is None  # on time: streak ends
    for step in (3, 4):
        watch.arrive(step, 0, 20.0 + step)
        found = watch.arrive(step, 1, 20.9 + step)
    assert found is not None and found["rank"] == 1 and [x["step"] for x in found["lags"]] == [3, 4]


def test_fault_clock_measures_detection_recovery_and_lost_steps():
    clock = FaultClock()
    clock.fault(100.0)
    incident = clock.detected("rank_died", 101.5)
    assert incident["time_to_detect_s"] == 1.5 and clock.recovering
    clock.restarted("rank_died", "fast")
    clock.lost(3)
    assert clock.resumed(104.0) == 2.5 and not clock.recovering
    assert clock.restarts_by_cause == {"rank_died": 1} and clock.steps_lost == 3


def test_an_attributed_sdc_quarantines_and_an_unattributed_one_only_suspects():
    policy = RestartPolicy()
    named = Failure(FailureKind.SDC, "vote", (2,), ("n2",), 3,
                    evidence={"evidence": {"ambiguous": False}})
    decision = policy.decide(named, 0)
    assert decision.quarantine_nodes == ("n2",) and decision.exclude_nodes == ("n2",)
    everyone = Failure(FailureKind.SDC, "loss spike", (0, 1), ("n1", "n2"), 3, evidence={"evidence": {}})
    decision = policy.decide(everyone, 0)
    assert decision.quarantine_nodes == () and decision.suspect_nodes == ("n1", "n2")


def test_replanner_keeps_the_global_batch_with_gradient_accumulation():
    layout = Layout(dp=4, micro_batch_size=2)
    topo = Topology.uniform(1, 1, 4, used={"r1-n1": 2})  # 2 GPUs left
    new = keep_global_batch_replanner(topo, layout)
    assert (new.dp, new.micro_batch_size, new.num_microbatches) == (2, 2, 2)
    assert new.global_batch == layout.global_batch
    policy = ReplanPolicy(replanner=keep_global_batch_replanner)
    decision = policy.on_unplaceable("short", layout, topo, 1, 0.0)
    assert decision.action == ScalingAction.REPLAN and decision.layout == new
    assert keep_global_batch_replanner(Topology.uniform(1, 1, 4, used={"r1-n1": 4}), layout) is None
