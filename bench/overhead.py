"""What running a job under Lattice costs, against the same training run without it.

The demo-sized job (examples/demo.yaml: preset "demo", 8 ranks, the planner's tp=2 pp=2 dp=2,
30 steps, a checkpoint every 10) runs three ways on one machine, one after the other:

1. Lattice: submitted over HTTP to the real service (embedded Ray cluster of 2 racks x 2 nodes x
   4 virtual GPUs, scheduler, controller actor, one rank actor per GPU);
2. torchrun-style: 8 spawned processes rendezvousing over TCP (env://), the engine called directly;
3. Ray Train: `ray.train.torch.TorchTrainer` with 8 workers of 1 GPU each on the same Ray cluster.

Every run uses the same RunConfig (so the three model digests must agree) and reports the time
from submit/launch to the end of the first step, and the steady-state step time: the engine's own
per-step measurement (median over the steps after the first `--warmup`), and the wall time per
step over the same steps (which includes the checkpoint saves). Lattice's step times are sampled by
polling its API every 50 ms (a step is seen at most ~0.3 s late: the scheduler's and the
controller's poll intervals), so its time to first step carries that resolution.

    python -m bench.overhead [--steps 30] [--warmup 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO_SPEC = ROOT / "examples" / "demo.yaml"


@dataclass
class Measure:
    name: str
    first_step_s: float
    step_s: float  # median engine-measured step time after warm-up
    wall_per_step_s: float  # wall time per step after warm-up (checkpoint saves included)
    digest: str | None


def _steady(samples: dict[int, tuple[float, float]], warmup: int) -> tuple[float, float]:
    """samples: step -> (wall time first seen, engine step time). Returns (median step, wall/step)."""
    steps = sorted(s for s in samples if s > warmup)
    if len(steps) < 2:
        return float("nan"), float("nan")
    median = statistics.median(samples[s][1] for s in steps)
    wall = (samples[steps[-1]][0] - samples[steps[0]][0]) / (steps[-1] - steps[0])
    return median, wall


# ---- 1: Lattice --------------------------------------------------------------------------------------
def run_lattice(spec: dict[str, Any], url: str, token: str, warmup: int) -> tuple[Measure, dict[str, Any]]:
    """The job through the service's API; returns the measure and the planned layout."""
    import httpx

    tokens_per_step = spec["train"]["global_batch"] * runtime_seq_len(spec)
    samples: dict[int, tuple[float, float]] = {}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        t0 = time.time()
        job = client.post("/v1/jobs", json=spec).raise_for_status().json()
        while True:
            job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
            p, now = job["progress"], time.time()
            if p["step"] and p["step"] not in samples and p["tokens_per_s"]:
                samples[p["step"]] = (now, tokens_per_step / p["tokens_per_s"])
            if job["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.05)
    if job["state"] != "succeeded":
        raise RuntimeError(f"the Lattice job {job['state']}: {job.get('error')}")
    first = samples[min(samples)][0] - t0
    median, wall = _steady(samples, warmup)
    return Measure("Lattice", first, median, wall, job["result"]["model_digest"]), job["plan"]["layout"]


def runtime_seq_len(spec: dict[str, Any]) -> int:
    from service.schemas import JobSpec

    return JobSpec.model_validate(spec).model_spec().seq_len


# ---- the engine under a hook that records when each step ended ------------------------------------------
def _timed_train(ctx: Any, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    import torch

    from training.config.run import RunConfig
    from training.train import TrainHooks, train

    torch.set_num_threads(1)
    times: list[tuple[int, float, float]] = []

    class Hooks(TrainHooks):
        def on_step(self, info: Any) -> None:
            times.append((info.step, time.time(), info.step_time_s))

    result = train(ctx, RunConfig.from_dict(cfg_dict), Hooks(), resume=False)
    return {"times": times, "digest": result.model_digest}


# ---- 2: torchrun-style processes ------------------------------------------------------------------------
def _direct_rank(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    import torch

    from training.parallel.dist import DistContext

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return _timed_train(ctx, cfg_dict)


def run_direct(cfg_dict: dict[str, Any], warmup: int) -> Measure:
    from bench._common import spawn

    t0 = time.time()
    out = spawn(8, _direct_rank, (cfg_dict,))
    return _measure("torchrun-style", out, t0, warmup)


def _measure(name: str, out: dict[str, Any], t0: float, warmup: int) -> Measure:
    samples = {step: (wall, st) for step, wall, st in out["times"]}
    median, wall = _steady(samples, warmup)
    return Measure(name, samples[min(samples)][0] - t0, median, wall, out["digest"])


# ---- 3: Ray Train ---------------------------------------------------------------------------------------
def _ray_train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import torch
    import torch.distributed as dist

    from training.parallel.dist import DistContext

    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=torch.device("cpu"),
                      backend=dist.get_backend())
    out = _timed_train(ctx, config["cfg"])
    if ctx.rank == 0:
        Path(config["out"]).write_text(json.dumps(out))
    ray.train.report({"final_step": len(out["times"])})


def run_ray_train(cfg_dict: dict[str, Any], warmup: int, workdir: Path) -> Measure:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out_file = workdir / "raytrain.json"
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"cfg": cfg_dict, "out": str(out_file)},
        # One (virtual) GPU per worker like Lattice's ranks; gloo because the GPUs are virtual.
        scaling_config=ScalingConfig(
            num_workers=8, use_gpu=True, resources_per_worker={"CPU": 0.1, "GPU": 1}
        ),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name="lattice-overhead", storage_path=str(workdir / "ray_results")),
    )
    t0 = time.time()
    trainer.fit()
    return _measure("Ray Train", json.loads(out_file.read_text()), t0, warmup)


# ---- main -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="Steps (default: the demo spec's).")
    parser.add_argument("--warmup", type=int, default=5, help="Steps left out of the steady state.")
    parser.add_argument("--rounds", type=int, default=1, help="Runs of each way; the medians are shown.")
    args = parser.parse_args(argv)

    from service.runtime import Runtime
    from service.schemas import JobSpec
    from service.settings import Settings
    from training.config.layout import Layout

    spec = yaml.safe_load(DEMO_SPEC.read_text())
    if args.steps:
        spec["train"]["steps"] = args.steps
    workdir = Path(tempfile.mkdtemp(prefix="lattice-overhead-"))
    settings = Settings(home=workdir / "home", log_level="warning", scheduler_interval_s=0.1,
                        ray_address=None, database_url=None, checkpoint_root=None, token_file=None)
    runtime = Runtime(settings).start()
    runs: dict[str, list[Measure]] = {}

    def record(m: Measure) -> None:
        runs.setdefault(m.name, []).append(m)
        print(m, flush=True)

    try:
        url = runtime.serve_in_thread(0)
        token = runtime.admin_token or settings.token_path.read_text().strip()
        plan_layout: dict[str, Any] = {}
        # Rounds alternate the three ways so that a busy spell of the machine hits them alike.
        for r in range(args.rounds):
            measure, plan_layout = run_lattice(spec, url, token, args.warmup)
            record(measure)
            cfg = JobSpec.model_validate(spec).to_run_config(Layout.from_dict(plan_layout), None).to_dict()
            # The same run with checkpoints in a fresh directory (the same saves as under Lattice).
            cfg["checkpoint"]["dir"] = str(workdir / f"ckpt-direct-{r}")
            record(run_direct(cfg, args.warmup))
            cfg["checkpoint"]["dir"] = str(workdir / f"ckpt-raytrain-{r}")
            try:
                record(run_ray_train(cfg, args.warmup, workdir))
            except ImportError as e:  # ray.train needs ray[train]'s extras (pandas, pyarrow, ...)
                print(f"Ray Train skipped: {e}", flush=True)
    finally:
        runtime.stop()
    report([_median(ms) for ms in runs.values()], spec, plan_layout, args.warmup, args.rounds)
    return 0


def _median(ms: list[Measure]) -> Measure:
    digests = {m.digest for m in ms}
    return Measure(
        ms[0].name, statistics.median(m.first_step_s for m in ms), statistics.median(m.step_s for m in ms),
        statistics.median(m.wall_per_step_s for m in ms), digests.pop() if len(digests) == 1 else "DIFFER",
    )


def report(results: list[Measure], spec: dict[str, Any], layout: dict[str, Any], warmup: int,
           rounds: int) -> None:
    base = {m.name: m for m in results}["torchrun-style"]
    now = datetime.datetime.now().isoformat(timespec="seconds")
    print(f"# bench/overhead.py  {now}  {platform.node()} {platform.machine()} x{os.cpu_count()} CPUs")
    print(f"job: preset {spec['model'].get('preset')}, {spec['train']['steps']} steps, global batch "
          f"{spec['train']['global_batch']}, layout tp={layout['tp']} pp={layout['pp']} dp={layout['dp']} "
          f"zero={layout['zero_stage']} m={layout['num_microbatches']}; steady state = steps > {warmup}; "
          f"median of {rounds} round(s)")
    print(f"{'run':<16}{'submit->1st step':>18}{'step (median)':>16}{'wall/step':>12}"
          f"{'1st step vs torchrun':>22}{'step vs torchrun':>18}")
    for m in results:
        print(f"{m.name:<16}{m.first_step_s:>16.2f} s{m.step_s * 1e3:>13.0f} ms"
              f"{m.wall_per_step_s * 1e3:>9.0f} ms{m.first_step_s / base.first_step_s:>21.2f}x"
              f"{m.step_s / base.step_s:>17.2f}x")
    lattice = next(m for m in results if m.name == "Lattice")
    for other in results:
        if other is lattice:
            continue
        print(f"Lattice / {other.name}: first step {lattice.first_step_s / other.first_step_s:.2f}x, "
              f"step {lattice.step_s / other.step_s:.2f}x, "
              f"wall/step {lattice.wall_per_step_s / other.wall_per_step_s:.2f}x")
    digests = ", ".join(f"{m.name} {str(m.digest)[:12]}" for m in results)
    same = len({m.digest for m in results}) == 1
    print(f"model digests {'agree' if same else 'DIFFER'}: {digests}")


if __name__ == "__main__":
    raise SystemExit(main())
