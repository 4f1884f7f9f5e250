"""Processes that trained with ZeRO-1 exit with status 0: no "terminate called without an active
exception" (SIGABRT) while the interpreter finalizes (see `training.parallel.dist.shutdown`).

One run of each kind is in `make test`; `make test-slow` repeats each 10 times, 0 aborts allowed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[2]
JOB = {
    "name": "exit",
    "model": {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 16},
    "data": {"kind": "synthetic", "seed": 1},
    "train": {"steps": 3, "global_batch": 4, "lr": 0.003, "seed": 0, "dp_impl": "lattice"},
    "parallelism": {"dp": 2, "zero_stage": 1},
    "checkpoint": {"every_steps": 2, "keep": 2},
    "resources": {"gpus": 2},
}


def _torchrun(tmp: Path) -> subprocess.CompletedProcess[str]:
    spec = tmp / "job.yaml"
    spec.write_text(yaml.safe_dump(JOB))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "training.run", "--spec", str(spec), "--checkpoint-dir", str(tmp / "ckpt"), "--no-resume"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def _zero1_tied(rank: int, world: int, steps: int) -> float:
    """The shape of the outside suite that aborted 1 run in 3: ShardedOptimizer over a model whose
    embedding and output head share one weight, in spawned processes."""
    import torch
    from torch import nn

    from training.parallel.zero import ShardedOptimizer

    torch.manual_seed(0)
    embed = nn.Embedding(64, 16)
    head = nn.Linear(16, 64, bias=False)
    head.weight = embed.weight  # tied
    model = nn.ModuleDict({"embed": embed, "mid": nn.Linear(16, 16), "head": head})
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    loss = torch.zeros(())
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8), generator=gen)
        logits = model["head"](torch.tanh(model["mid"](model["embed"](tokens))))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # average gradients as DDP would (ZeRO-1 shards only the state)
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    return float(loss)


def _check_torchrun(tmp: Path) -> None:
    proc = _torchrun(tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert "final_step=3" in proc.stdout


def test_torchrun_zero1_job_exits_cleanly(tmp_path: Path) -> None:
    _check_torchrun(tmp_path)


def test_spawned_zero1_tied_weights_exit_cleanly() -> None:
    losses = run_ranks(2, _zero1_tied, args=(3,), start_method="spawn")  # RankFailed on a non-zero exit
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(10))
def test_torchrun_zero1_job_exits_cleanly_repeatedly(tmp_path: Path, attempt: int) -> None:
    _check_torchrun(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(10))
def test_spawned_zero1_tied_weights_exit_cleanly_repeatedly(attempt: int) -> None:
    assert len(run_ranks(2, _zero1_tied, args=(3,), start_method="spawn")) == 2
