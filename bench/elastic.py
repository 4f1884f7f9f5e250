"""Growing back: an elastic job shrunk from DP 4 to DP 2 by the loss of its node's ranks grows back
to DP 4 when the node returns (issue 17's elastic target).

    python -m bench.elastic            # 60 steps, checkpoint every 5

On the embedded cluster (1 rack x 2 nodes x 4 virtual GPUs), with 2 GPUs of the second node held by
another reservation: the job starts at DP 4 on the first node; that node is cordoned and all four
ranks die, so the job can only come back at DP 2 (2 micro-batches: the global batch is kept) on the
second node; then the first node is uncordoned. Printed: the shrink and the grow (plan diffs), the
steps and seconds from the node's return to the grown layout against the checkpoint interval, and
the run against a fault-free DP 4 run of the same job: the losses after the grow and the final
weights (allclose 1e-4; the same global batch, so the same training mathematics).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

from training.config.layout import Layout
from training.config.run import CheckpointConfig, RunConfig
from training.config.spec import ModelSpec

SPEC = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq_len=32)


def _cfg(ckpt: str, steps: int, every: int) -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(dp=4), steps=steps,
                     checkpoint=CheckpointConfig(dir=ckpt, every_steps=every))


def _wait(handle: Any, done: Any, what: str, timeout_s: float = 300.0) -> dict[str, Any]:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = ray.get(handle.poll.remote(0))
        if done(snap):
            return snap
        if snap["terminal"] and not done(snap):
            raise RuntimeError(f"{what}: the job ended {snap['state']}: {snap['reason']}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out waiting for {what}")


def _replans(snap: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in snap["events"] if e["kind"] == "replanned"]


def _final_params(ckpt_dir: str, step: int, out: str) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(ckpt_dir, f"step-{step}"), out)
    return torch.load(out)["model"]


def run(steps: int, every: int, root: str) -> dict[str, Any]:
    import ray
    from ray.util.placement_group import placement_group

    from workers.controller import ControllerOptions, kill_controller, start_controller
    from workers.controller.elastic import elastic_policy
    from workers.placement import NODE_ID_LABEL, release
    from workers.topology import Topology

    opts = ControllerOptions(poll_interval_s=0.1, hang_timeout_s=30.0)
    ref_cfg = _cfg(os.path.join(root, "ref"), steps, every)
    handle = start_controller("bench-elastic-ref", ref_cfg, options=opts)
    try:
        ref = _wait(handle, lambda s: s["terminal"], "the fault-free run")
    finally:
        kill_controller("bench-elastic-ref")
    home, other = Topology.from_ray(include_dead=False).gpu_nodes[:2]
    blocker = placement_group([{"GPU": 1.0}] * 2, strategy="PACK",
                              bundle_label_selector=[{NODE_ID_LABEL: other.node_id}] * 2)
    assert blocker.wait(timeout_seconds=60)
    cfg = _cfg(os.path.join(root, "elastic"), steps, every)
    handle = start_controller("bench-elastic", cfg, options=opts, scaling_policy=elastic_policy(2, 4))
    try:
        snap = _wait(handle, lambda s: (s["progress"]["step"] or 0) >= 3, "the job to train at DP 4")
        home = next(n for n in Topology.from_ray(include_dead=False).gpu_nodes
                    if n.name == snap["placement"][0]["node_name"])
        ray.get(handle.update_nodes.remote({}, [home.name]))
        at = (snap["progress"]["step"] or 0) + 2
        for r in range(4):
            ray.get(handle.inject_fault.remote("kill_rank", r, at))
        snap = _wait(handle, lambda s: _replans(s) and s["state"] == "RUNNING"
                     and (s["progress"]["step"] or 0) >= at + 2, "the shrink")
        shrink = _replans(snap)[0]
        returned_step, returned_t = snap["progress"]["step"], time.time()
        ray.get(handle.update_nodes.remote({}, []))
        snap = _wait(handle, lambda s: any(e.get("grew") for e in _replans(s)), "the grow")
        grow = next(e for e in _replans(snap) if e.get("grew"))
        final = _wait(handle, lambda s: s["terminal"], "the end")
    finally:
        kill_controller("bench-elastic")
        release(blocker)
    if final["state"] != "FINISHED":
        raise RuntimeError(f"elastic job: {final['state']}: {final['reason']}")
    return {"ref": ref, "final": final, "shrink": shrink, "grow": grow, "returned_step": returned_step,
            "grow_steps": grow["step"] - returned_step, "grow_s": grow["ts"] - returned_t,
            "ref_dir": ref_cfg.checkpoint.dir, "dir": cfg.checkpoint.dir}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    a = parser.parse_args(argv)

    import torch

    from bench._common import machine
    from workers.cluster import start_embedded_cluster

    root = tempfile.mkdtemp(prefix="lelastic-")
    cluster = start_embedded_cluster(racks=1, nodes_per_rack=2, gpus_per_node=4, temp_dir=root + "/ray",
                                     cpus_per_node=2)
    try:
        r = run(a.steps, a.every, root)
    finally:
        cluster.shutdown()
    ref_losses, losses = r["ref"]["result"]["losses"], r["final"]["result"]["losses"]
    tail = ref_losses[len(ref_losses) - len(losses):]
    ref_w = _final_params(r["ref_dir"], a.steps, os.path.join(root, "ref.pt"))
    got_w = _final_params(r["dir"], a.steps, os.path.join(root, "got.pt"))
    weights_close = all(torch.allclose(got_w[k], v, atol=1e-4, rtol=1e-4) for k, v in ref_w.items())
    losses_close = torch.allclose(torch.tensor(losses), torch.tensor(tail), atol=1e-4, rtol=1e-4)
    print(f"# bench.elastic — {machine()}")
    print(f"tiny GPT ({SPEC.layers}x{SPEC.hidden}), {a.steps} steps, checkpoint every {a.every}\n")
    print(f"shrink: {r['shrink']['diff']} (global batch kept: {r['shrink']['global_batch_kept']})")
    print(f"grow:   {r['grow']['diff']} at the checkpoint of step {r['grow']['step']}")
    print(f"node returned at step {r['returned_step']}; grown {r['grow_steps']} step(s) and "
          f"{r['grow_s']:.2f} s later (checkpoint interval: {a.every} steps; within it: "
          f"{r['grow_steps'] <= a.every})")
    print(f"losses after the grow ({len(losses)} steps) allclose 1e-4 to the fault-free run: {losses_close}")
    print(f"final weights allclose 1e-4 to the fault-free run: {weights_close}")


if __name__ == "__main__":
    main()
