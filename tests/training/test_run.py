"""`torchrun -m training.run --spec job.yaml`: the job yaml mapping, and one real 2-process run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from training.config.layout import LayoutError
from training.config.spec import SpecError
from training.run import run_config_from_job

MODEL = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16}
JOB = {
    "name": "tiny",
    "priority": 0,
    "model": MODEL,
    "data": {"kind": "synthetic", "seed": 1},
    "train": {"steps": 3, "global_batch": 4, "lr": 0.003, "seed": 0, "dp_impl": "lattice"},
    "parallelism": {"dp": 2, "zero_stage": 1},
    "checkpoint": {"every_steps": 2, "keep": 2},
    "resources": {"gpus": 2},
}


def test_job_yaml_maps_to_a_run_config() -> None:
    cfg = run_config_from_job(JOB, world_size=2)
    assert cfg.model.layers == 2 and cfg.steps == 3 and cfg.optim.lr == 0.003
    assert cfg.layout.dp == 2 and cfg.layout.zero_stage == 1
    assert cfg.layout.micro_batch_size == 2  # derived: global_batch / (dp x num_microbatches)
    assert cfg.global_batch == 4 and cfg.data.seed == 1 and cfg.checkpoint.every_steps == 2


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"model": {"preset": "demo"}}, SpecError, "model.preset"),
        ({"parallelism": "auto"}, LayoutError, "planner"),
        ({"train": {"steps": 3, "global_batch": 5}}, LayoutError, "train.global_batch"),
        ({"train": {"steps": 3, "warmup": 2}}, SpecError, "warmup"),
        ({"data": {"kind": "synthetic", "shuffle": True}}, SpecError, "unknown data field"),
        ({"parallelism": {"dp": 4}}, LayoutError, "world size"),
    ],
)
def test_job_yaml_errors_name_the_field(change, error, match) -> None:
    with pytest.raises(error, match=match):
        run_config_from_job({**JOB, **change}, world_size=2)


def test_torchrun_two_processes(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(JOB))
    ckpt = tmp_path / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training.run", "--spec", str(spec), "--steps", "3", "--checkpoint-dir", str(ckpt)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    match = re.search(r"final_step=(\d+) model_digest=([0-9a-f]{64})", proc.stdout)
    assert match and match.group(1) == "3", proc.stdout
    assert "step 3 loss" in proc.stderr  # rank 0 logs progress
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-3"]
