"""Recovery from a killed rank: Lattice's controller against Ray Train.

    python -m bench.recovery                   # 250 steps, checkpoint every 5, kill the last rank at 82
    python -m bench.recovery --skip-ray-train  # Lattice only (Ray Train needs pandas + pyarrow)
    python -m bench.recovery --hsdp            # only ZeRO-3 as HSDP (dp_replicate 2), DP 4, vs Ray Train

The same small job (the training engine's tiny GPT, the same DCP checkpoints every `--every`
steps) runs on the same embedded cluster (1 rack x 2 nodes x 4 virtual GPUs), and its last rank
SIGKILLs itself after step `--kill-at`. Measured from the kill to the first step completed after
recovery, with the steps lost (computed before the kill and thrown away by the restore). DP 2:

- Lattice, peer path + a warm spare: the replacement is a hot spare (workers.spares) and takes its
  DP peer's in-memory state (training.checkpoint.peer): nothing rolls back;
- Lattice, peer path: the same with a new replacement actor, in a warm worker process kept on the node
  (workers.warm_workers: started with the ranks, torch and the engine imported);
- Lattice, peer path, cold process: the same with no warm process kept (`warm_workers=0`);
- Lattice, fast path from the checkpoint (peer recovery off): only the dead rank is replaced;
- Lattice, full restart: every rank re-placed and restarted (the fast path switched off);
- Ray Train: `TorchTrainer` with `FailureConfig(max_failures=3)`; its worker loop resumes from the
  newest checkpoint of the same directory (so both pay the same load), Ray Train restarts the group.

DP 1 (no peer: the checkpoint): Lattice with a warm spare against Ray Train with one worker.
The kill lands at step 82 (~8 s into training here), past the job's start-up: a fault at step 12 lands
while the warm processes are still importing on these 2 cores (`--kill-at 12` shows it), which a job
that runs for hours spends a negligible part of its life in. Every system is killed at the same step.
Targets (issue 17): peer path <= 0.25x Ray Train with 0 steps lost and bit-identical weights;
DP 1 with a warm spare <= 0.4x Ray Train.
"""

from __future__ import annotations

import argparse
import functools
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


def _cfg(ckpt: str, steps: int, every: int, dp: int = 2, zero: int = 0, tp: int = 1, replicate: int = 1
         ) -> RunConfig:
    # ZeRO-1 runs keep shadow shards (fault_tolerance.shadow_optimizer): their peer path needs them.
    layout = Layout(dp=dp, tp=tp, micro_batch_size=2, zero_stage=zero, dp_replicate=replicate)
    return RunConfig(model=SPEC, layout=layout,
                     steps=steps, checkpoint=CheckpointConfig(dir=ckpt, every_steps=every),
                     shadow_optimizer=zero == 1)


def run_lattice(steps: int, every: int, kill_at: int, root: str, *, name: str, dp: int = 2, fast: bool = True,
                peer: bool = True, spares: int = 0, zero: int = 0, warm: int = 1, tp: int = 1,
                kind: str = "kill_rank", replicate: int = 1) -> dict[str, Any]:
    import ray

    from workers.controller import ControllerOptions, kill_controller, start_controller

    job = f"bench-recovery-{name}"
    cfg = _cfg(os.path.join(root, job), steps, every, dp, zero, tp, replicate)
    kill = {"kind": kind, "rank": dp * tp - 1, "at_step": kill_at}
    opts = ControllerOptions(poll_interval_s=0.1, fast_path=fast, peer_recovery=peer, spares=spares,
                             warm_workers=warm, hang_timeout_s=30.0, faults=() if spares else (kill,),
                             # a run's own runtime env: no run takes an earlier run's warm processes
                             env_vars={"LATTICE_BENCH_RUN": name})
    handle = start_controller(job, cfg, options=opts)
    try:
        # The kill once the spare is warm (started with the ranks, warm once its engine is imported,
        # a few seconds): the job must still be running then, hence the bench's 250 steps.
        if spares:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                snap = ray.get(handle.poll.remote(0))
                if any(s.get("state") == "warm" for s in snap.get("spares") or []):
                    break
                time.sleep(0.1)
            at = max(kill_at, (snap["progress"]["step"] or 0) + 2)
            ray.get(handle.inject_fault.remote("kill_rank", dp - 1, at))
        while True:
            snap = ray.get(handle.poll.remote(0))
            if snap["terminal"]:
                break
            time.sleep(0.2)
    finally:
        kill_controller(job)
    if snap["state"] != "FINISHED":
        raise RuntimeError(f"{job}: {snap['state']}: {snap['reason']}")
    incidents = snap["faults"]["incidents"]
    incident = incidents[0] if len(incidents) == 1 else None
    if incident is None or incident["time_to_detect_s"] is None:
        failures = [e.get("message") for e in snap["events"] if e["kind"] == "failure"]
        raise RuntimeError(f"{job}: expected the one incident of the kill, got {incidents}: {failures}")
    fault = next(e for e in snap["events"] if e["kind"] == "fault_injected")
    restore = next(e for e in snap["events"] if e["kind"] == "restore")
    restart = next(e for e in snap["events"] if e["kind"] == "restart")
    return {"path": restart["path"], "spare": bool(restart.get("spare_used")),
            "warm_process": restart.get("warm_process"),
            "kill_to_step_s": incident["time_to_detect_s"] + incident["time_to_recover_s"],
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
            if rank == world - 1 and info.step == config["kill_at"] and not marker.exists():
                marker.write_text(json.dumps({"t": time.time(), "step": info.step}))
                os.kill(os.getpid(), signal.SIGKILL)

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    result = train(ctx, RunConfig.from_dict(config["cfg"]), Hooks(), resume=True)
    if rank == 0:
        Path(config["result"]).write_text(json.dumps({"digest": result.model_digest}))


def run_ray_train(steps: int, every: int, kill_at: int, root: str, dp: int = 2, zero: int = 0,
                  replicate: int = 1) -> dict[str, Any]:
    from ray.train import FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    base = Path(root) / f"raytrain-dp{dp}-z{zero}-r{replicate}"
    base.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(str(base / "ckpt"), steps, every, dp, zero, replicate=replicate)
    config = {"cfg": cfg.to_dict(), "kill_at": kill_at, "log": str(base / "steps.jsonl"),
              "marker": str(base / "killed.json"), "result": str(base / "result.json")}
    trainer = TorchTrainer(
        _ray_train_loop, train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=dp, use_gpu=False, resources_per_worker={"CPU": 0.1}),
        run_config=RayRunConfig(storage_path=str(base / "storage"), name=f"bench-recovery-{base.name}",
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
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--kill-at", type=int, default=82)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument("--node-loss", action="store_true",
                        help="only: TP 2 x DP 2, one replica's node removed; standby warm processes vs none")
    parser.add_argument("--hsdp", action="store_true",
                        help="only: ZeRO-3 as HSDP (DP 4 = 2 replicate groups x 2 shards) vs Ray Train")
    a = parser.parse_args(argv)
    if a.node_loss:
        return node_loss(a.steps, a.every, a.kill_at)
    if a.hsdp:
        return hsdp(a.steps, a.every, a.kill_at, a.skip_ray_train)

    from bench._common import machine
    from workers.cluster import start_embedded_cluster

    root = tempfile.mkdtemp(prefix="lrec-")
    cluster = start_embedded_cluster(racks=1, nodes_per_rack=2, gpus_per_node=4, temp_dir=root + "/ray",
                                     cpus_per_node=2)
    rows: list[tuple[str, dict[str, Any]]] = []
    dp1: list[tuple[str, dict[str, Any]]] = []
    zero1: list[tuple[str, dict[str, Any]]] = []
    try:
        run = functools.partial(run_lattice, a.steps, a.every, a.kill_at, root)
        rows.append(("Lattice peer path + spare", run(name="peer-spare", spares=1)))
        rows.append(("Lattice peer path", run(name="peer")))
        rows.append(("Lattice peer path, cold proc", run(name="peer-cold", warm=0)))
        rows.append(("Lattice fast path (ckpt)", run(name="fast", peer=False)))
        rows.append(("Lattice full restart", run(name="full", fast=False)))
        dp1.append(("Lattice DP 1 + spare", run(name="dp1-spare", dp=1, spares=1)))
        zero1.append(("Lattice peer path + spare", run(name="zero1-peer-spare", spares=1, zero=1)))
        zero1.append(("Lattice peer path", run(name="zero1-peer", zero=1)))
        zero1.append(("Lattice peer path, cold proc", run(name="zero1-peer-cold", zero=1, warm=0)))
        zero1.append(("Lattice fast path (ckpt)", run(name="zero1-fast", peer=False, zero=1)))
        if not a.skip_ray_train:
            rows.append(("Ray Train TorchTrainer", run_ray_train(a.steps, a.every, a.kill_at, root)))
            dp1.append(("Ray Train DP 1", run_ray_train(a.steps, a.every, a.kill_at, root, dp=1)))
    finally:
        cluster.shutdown()
    print(f"# bench.recovery — {machine()}")
    print(f"tiny GPT ({SPEC.layers}x{SPEC.hidden}), {a.steps} steps, checkpoint every {a.every}, "
          f"the last rank SIGKILLed after step {a.kill_at}\n")
    for title, table in (("DP 2", rows), ("DP 1 (no peer)", dp1), ("DP 2, ZeRO-1 with shadow shards", zero1)):
        print(f"{title}\n{'system':28s} {'path':>6s} {'spare':>6s} {'warm proc':>9s} "
              f"{'kill -> first step (s)':>23s} {'steps lost':>11s} {'restored':>9s}")
        for name, r in table:
            print(f"{name:28s} {r.get('path', '-'):>6s} {str(r.get('spare', '-')):>6s} "
                  f"{str(r.get('warm_process', '-')):>9s} "
                  f"{r['kill_to_step_s']:23.2f} {r['lost']:11d} {r['restored']:9d}")
        print(f"final weights identical across runs: {len({r['digest'] for _, r in table}) == 1}\n")
    if a.skip_ray_train:
        return
    ray_s, ray1_s = rows[-1][1]["kill_to_step_s"], dp1[-1][1]["kill_to_step_s"]
    for name, r in rows[:-1]:
        print(f"ratio {name} / Ray Train: {r['kill_to_step_s'] / ray_s:.2f}"
              + (" (target <= 0.25, 0 steps lost)" if name.startswith("Lattice peer") else ""))
    dp1_ratio = dp1[0][1]["kill_to_step_s"] / ray1_s
    print(f"ratio Lattice DP 1 + spare / Ray Train DP 1: {dp1_ratio:.2f} (target <= 0.4)")
    for name, r in zero1:
        print(f"ratio ZeRO-1 {name} / Ray Train (DDP): {r['kill_to_step_s'] / ray_s:.2f}")


def node_loss(steps: int, every: int, kill_at: int) -> None:
    """A replica's node lost (TP 2 x DP 2 on 1 rack x 4 nodes x 2 GPUs: each TP pair fills a node): the
    pair moves whole to a free node and takes the other replica's state. With warm processes the
    worker group keeps two on that node beforehand (the standby node, workers.warm_workers); with
    `warm_workers=0` the pair starts cold there. Detection (Ray declaring the node dead) is the same."""
    from bench._common import machine
    from workers.cluster import start_embedded_cluster
    from workers.node_killer import NodeKillService

    root = tempfile.mkdtemp(prefix="lrec-")
    cluster = start_embedded_cluster(racks=1, nodes_per_rack=4, gpus_per_node=2, temp_dir=root + "/ray",
                                     cpus_per_node=2)
    killer = NodeKillService(cluster)
    rows = []
    try:
        run = functools.partial(run_lattice, steps, every, kill_at, root, tp=2, kind="kill_node")
        rows.append(("standby warm processes", run(name="node-warm")))
        rows.append(("cold (warm_workers=0)", run(name="node-cold", warm=0)))
    finally:
        killer.stop()
        cluster.shutdown()
    print(f"# bench.recovery --node-loss — {machine()}")
    print(f"tiny GPT ({SPEC.layers}x{SPEC.hidden}), TP 2 x DP 2, {steps} steps, checkpoint every {every}, "
          f"rank 3's node removed after step {kill_at}\n")
    print(f"{'replacement processes':24s} {'path':>6s} {'warm proc':>9s} {'detect (s)':>10s} "
          f"{'recover (s)':>11s} {'kill -> first step (s)':>23s} {'steps lost':>11s}")
    for name, r in rows:
        print(f"{name:24s} {r['path']:>6s} {str(r['warm_process']):>9s} {r['detect_s']:10.2f} "
              f"{r['recover_s']:11.2f} {r['kill_to_step_s']:23.2f} {r['lost']:11d}")
    print(f"final weights identical: {len({r['digest'] for _, r in rows}) == 1}")


def hsdp(steps: int, every: int, kill_at: int, skip_ray_train: bool) -> None:
    """ZeRO-3 over DP 4 as HSDP (dp_replicate 2): rank 3 killed, its shard taken from rank 1."""
    from bench._common import machine
    from workers.cluster import start_embedded_cluster

    root = tempfile.mkdtemp(prefix="lrec-hsdp-")
    cluster = start_embedded_cluster(racks=1, nodes_per_rack=2, gpus_per_node=4, temp_dir=root + "/ray",
                                     cpus_per_node=2)
    kw = {"dp": 4, "zero": 3, "replicate": 2}
    try:
        run = functools.partial(run_lattice, steps, every, kill_at, root, **kw)
        rows = [("Lattice peer path", run(name="hsdp-peer")),
                ("Lattice peer path, cold proc", run(name="hsdp-peer-cold", warm=0)),
                ("Lattice fast path (ckpt)", run(name="hsdp-fast", peer=False))]
        if not skip_ray_train:
            rows.append(("Ray Train TorchTrainer", run_ray_train(steps, every, kill_at, root, **kw)))
    finally:
        cluster.shutdown()
    print(f"# bench.recovery --hsdp — {machine()}")
    print(f"tiny GPT ({SPEC.layers}x{SPEC.hidden}), ZeRO-3, DP 4 = 2 replicate groups x 2 shards, {steps} "
          f"steps, checkpoint every {every}, rank 3 SIGKILLed after step {kill_at}\n")
    print(f"{'system':28s} {'path':>6s} {'kill -> first step (s)':>23s} {'steps lost':>11s} {'restored':>9s}")
    for name, r in rows:
        print(f"{name:28s} {r.get('path', '-'):>6s} {r['kill_to_step_s']:23.2f} {r['lost']:11d} "
              f"{r['restored']:9d}")
    print(f"final weights identical across runs: {len({r['digest'] for _, r in rows}) == 1}")
    if not skip_ray_train:
        ray_s = rows[-1][1]["kill_to_step_s"]
        for name, r in rows[:-1]:
            print(f"ratio {name} / Ray Train (same job): {r['kill_to_step_s'] / ray_s:.2f}"
                  + (" (target <= 0.25, 0 steps lost)" if name.startswith("Lattice peer") else ""))


if __name__ == "__main__":
    main()
