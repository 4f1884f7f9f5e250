"""A train function for the service-kill matrix: the real engine (training.train.train) with a
gate that holds every rank at one exact point of the job until the test opens it, so that the
service can be killed there and not merely "about then".

The gate is configured per job through the ranks' environment (ControllerOptions.env_vars):

    LATTICE_TEST_GATE = '{"dir": "/tmp/.../gate", "phase": "step" | "checkpoint", "step": N}'

- phase "step": after step N's hook has reported the step (the controller and the service see
  step N done), before the step's control all-reduce;
- phase "checkpoint": when the checkpoint save of step N begins (on_checkpoint_start: the
  controller is CHECKPOINTING), before any rank writes a byte of it.

Each rank writes `<dir>/held-<rank>` when it stops at the gate and goes on once `<dir>/release`
exists (at once if it already does: the ranks of a later attempt never stop), or after
`HOLD_TIMEOUT_S` so that a failed test never leaves ranks stuck. No rank is inside a collective
while held, so holding does not trip gloo's timeouts; the test raises the controller's hang
timeout above the hold. The gate changes nothing in the mathematics of the job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

GATE_ENV = "LATTICE_TEST_GATE"
TRAIN_FN = "tests.faults.service_gate:gated_train"
HOLD_TIMEOUT_S = 180.0


def gate_env(directory: Path, phase: str, step: int) -> dict[str, str]:
    """The env_vars (ControllerOptions.env_vars) that make the job's ranks stop at the gate."""
    if phase not in ("step", "checkpoint"):
        raise ValueError(f"phase must be 'step' or 'checkpoint', got {phase!r}")
    directory.mkdir(parents=True, exist_ok=True)
    return {GATE_ENV: json.dumps({"dir": str(directory), "phase": phase, "step": int(step)})}


def held_ranks(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("held-")) for p in directory.glob("held-*"))


def release(directory: Path) -> None:
    (directory / "release").touch()


def _hold(directory: Path, rank: int) -> None:
    opened = directory / "release"
    if opened.exists():
        return
    (directory / f"held-{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not opened.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def gated_train(ctx: Any, cfg: Any, hooks: Any = None, **kwargs: Any) -> Any:
    from training.train import TrainHooks, train

    hooks = hooks if hooks is not None else TrainHooks()
    raw = os.environ.get(GATE_ENV)
    if raw:
        gate = json.loads(raw)
        directory, phase, at = Path(gate["dir"]), gate["phase"], int(gate["step"])
        if phase == "step":
            inner_step = hooks.on_step

            def on_step(info: Any) -> Any:
                action = inner_step(info)  # the step is reported first: the controller sees it done
                if info.step == at:
                    _hold(directory, ctx.rank)
                return action

            hooks.on_step = on_step
        else:
            inner_start = hooks.on_checkpoint_start

            def on_checkpoint_start(step: int) -> None:
                inner_start(step)  # the save is open (the controller is CHECKPOINTING)...
                if step == at:
                    _hold(directory, ctx.rank)  # ...and nothing of it is written yet

            hooks.on_checkpoint_start = on_checkpoint_start
    return train(ctx, cfg, hooks, **kwargs)
