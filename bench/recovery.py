"""Recovery from a killed rank: Lattice's controller against Ray Train.

    python -m bench.recovery                   # DP 2, 24 steps, checkpoint every 5, kill rank 1 at 12
    python -m bench.recovery --skip-ray-train  # Lattice only (Ray Train needs pandas + pyarrow)

The same small job (the training engine's tiny GPT, the same DCP checkpoints every `--every`
steps) runs on the same embedded cluster (1 rack x 2 nodes x 4 virtual GPUs), and rank 1 SIGKILLs
itself after step `--kill-at`. Measured from the kill to the first step completed after recovery,
with the steps lost (computed before the kill and thrown away by the restore):

- Lattice, fast path: the controller replaces only the dead rank and re-rendezvouses the others;
- Lattice, full restart: every rank re-placed and restarted (the fast path switched off);
- Ray Train: `TorchTrainer` with `FailureConfig(max_failures=3)`; its worker loop resumes from the
  newest checkpoint of the same directory (so both pay the same load), Ray Train restarts the group.

The ratio Lattice / Ray Train is printed; the target is <= 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32)


def _cfg(ckpt: str, steps: int, every: int) -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(dp=2, micro_batch_size=2), steps=steps,
                     checkpoint=CheckpointConfig(dir=ckpt, every_steps=every))


def run_lattice(steps: int, every: int, kill_at: int, fast: bool, root: str) -> dict[str, Any]:
    import ray

    from workers.controller import ControllerOptions, kill_controller, start_controller

    job = f"bench-recovery-{'fast' if fast else 'full'}"
    cfg = _cfg(os.path.join(root, job), steps, every)
    opts = ControllerOptions(poll_interval_s=0.1, fast_path=fast, hang_timeout_s=30.0,
                             faults=({"kind": "kill_rank", "rank": 1, "at_step": kill_at},))
    handle = start_controller(job, cfg, options=opts)
    try:
        while True:
            snap = ray.get(handle.poll.remote(0))
            if snap["terminal"]:
                break
            time.sleep(0.2)
    finally:
        kill_controller(job)
    if snap["state"] != "FINISHED":
        raise RuntimeError(f"{job}: {snap['state']}: {snap['reason']}")
    incident = snap["faults"]["incidents"][0]
    fault = next(e for e in snap["events"] if e["kind"] == "fault_injected")
    restore = next(e for e in snap["events"] if e["kind"] == "restore")
    return {"kill_to_step_s": incident["time_to_detect_s"] + incident["time_to_recover_s"],
            "detect_s": incident["time_to_detect_s"], "recover_s": incident["time_to_recover_s"],
            "lost": restore["steps_lost"], "restored": restore["step"], "kill_step": fault["step"],
            "digest": snap["result"]["model_digest"]}


def _ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train worker: the same engine and checkpoints; logs step times and kills rank 1 once."""
    import torch
    import torch.distributed as dist

    from training.parallel.dist import DistContext
    from training.train import StepInfo, TrainHooks, train

    rank, world = dist.get_rank(), dist.get_world_size()
    log = Path(config["log"])
    marker = Path(config["marker"])

    class Hooks(TrainHooks):
        def on_restore(self, step: int | None) -> None:
            if rank == 0:
                with log.open("a") as f:
                    f.write(json.dumps({"restored": step or 0, "t": time.time()}) + "\n")

        def on_step(self, info: StepInfo) -> None:
            if rank == 0:
                with log.open("a") as f:
                    f.write(json.dumps({"step": info.step, "t": time.time()}) + "\n")
            if rank == 1 and info.step == config["kill_at"] and not marker.exists():
                marker.write_text(json.dumps({"t": time.time(), "step": info.step}))
                os.kill(os.getpid(), signal.SIGKILL)

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    result = train(ctx, RunConfig.from_dict(config["cfg"]), Hooks(), resume=True)
    if rank == 0:
        Path(config["result"]).write_text(json.dumps({"digest": result.model_digest}))


def run_ray_train(steps: int, every: int, kill_at: int, root: str) -> dict[str, Any]:
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    base = Path(root) / "raytrain"
    base.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(str(base / "ckpt"), steps, every)
    config = {"cfg": cfg.to_dict(), "kill_at": kill_at, "log": str(base / "steps.jsonl"),
              "marker": str(base / "killed.json"), "result": str(base / "result.json")}
    trainer = TorchTrainer(
        _ray_train_loop, train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.1}),
        run_config=RayRunConfig(storage_path=str(base / "storage"), name="bench-recovery",
                                failure_config=FailureConfig(max_failures=3)),
    )
    trainer.fit()
    killed = json.loads(Path(config["marker"]).read_text())
    lines = [json.loads(x) for x in Path(config["log"]).read_text().splitlines()]
    after = [x for x in lines if x["t"] > killed["t"]]
    # rank 0 may log the kill step itself just after rank 1 died: the first step that counts is
    # the first one logged after the restore.
    at = next(i for i, x in enumerate(after) if "restored" in x)
    restored = after[at]["restored"]
    first = next(x for x in after[at:] if "step" in x)
    return {"kill_to_step_s": first["t"] - killed["t"], "lost": killed["step"] - restored,
            "restored": restored, "kill_step": killed["step"],
            "digest": json.loads(Path(config["result"]).read_text())["digest"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=12)
    parser.add_argument("--skip-ray-train", action="store_true")
    a = parser.parse_args(argv)

    from bench._common import machine
    from workers.cluster import start_embedded_cluster

    root = tempfile.mkdtemp(prefix="lrec-")
    cluster = start_embedded_cluster(racks=1, nodes_per_rack=2, gpus_per_node=4, temp_dir=root + "/ray",
                                     cpus_per_node=2)
    rows = []
    try:
        fast = run_lattice(a.steps, a.every, a.kill_at, True, root)
        rows.append(("Lattice (fast path)", fast))
        full = run_lattice(a.steps, a.every, a.kill_at, False, root)
        rows.append(("Lattice (full restart)", full))
        if not a.skip_ray_train:
            rows.append(("Ray Train TorchTrainer", run_ray_train(a.steps, a.every, a.kill_at, root)))
    finally:
        cluster.shutdown()
    print(f"# bench.recovery — {machine()}")
    print(f"DP 2 tiny GPT ({SPEC.layers}x{SPEC.hidden}), {a.steps} steps, checkpoint every {a.every}, "
          f"rank 1 SIGKILLed after step {a.kill_at}\n")
    print(f"{'system':26s} {'kill -> first step (s)':>23s} {'steps lost':>11s} {'restored':>9s}")
    for name, r in rows:
        print(f"{name:26s} {r['kill_to_step_s']:23.2f} {r['lost']:11d} {r['restored']:9d}")
    digests = {r["digest"] for _, r in rows}
    print(f"\nfinal weights identical across runs: {len(digests) == 1}")
    if len(rows) == 3:
        ratio = rows[0][1]["kill_to_step_s"] / rows[2][1]["kill_to_step_s"]
        print(f"ratio Lattice fast path / Ray Train: {ratio:.2f} (target <= 0.5)")
        print(f"ratio Lattice full restart / Ray Train: "
              f"{rows[1][1]['kill_to_step_s'] / rows[2][1]['kill_to_step_s']:.2f}")


if __name__ == "__main__":
    main()
