"""Failover of the scheduler: SIGKILL the leader while a job trains, and time the standby's takeover.

    python -m bench.failover                 # PostgreSQL (LATTICE_TEST_POSTGRES_URL or the local server)
    python -m bench.failover --db sqlite     # a SQLite file (a dead holder on this host is replaced at once)

One embedded Ray cluster (1 rack x 2 nodes x 4 virtual GPUs, started by this script), one
`lattice serve --role api` and two `lattice serve --role scheduler` processes on one database. A
small seeded DP=2 job (24 steps, a checkpoint every 4, every rank slowed equally so it is still
running at the kill) is submitted; after its first stored checkpoint the leader scheduler is
SIGKILLed. Printed: the time from the kill to the standby holding the lease, and to its first
reconcile (the job's `reattached` event); whether the job finished with the same model digest as
the same job trained without the service and without the kill (the peer measured in this run).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench._common import healthz_up, wait_for

ROOT = Path(__file__).resolve().parents[1]
SEED, STEPS, EVERY, DP = 11, 24, 4, 2
SPEC: dict[str, Any] = {
    "name": "bench-failover",
    "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16},
    "data": {"kind": "synthetic", "seed": SEED},
    "train": {"steps": STEPS, "global_batch": DP, "lr": 0.003, "seed": SEED},
    "parallelism": {"dp": DP},
    "resources": {"gpus": DP},
    "checkpoint": {"every_steps": EVERY, "keep": 3},
    "faults": [{"kind": "slow_rank", "rank": r, "at_step": 1, "seconds": 0.5} for r in range(DP)],
}


def _digest_rank(rank: int, world: int, cfg: dict[str, Any]) -> str:
    import torch

    from training.config.run import RunConfig
    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank=rank, world_size=world, device=torch.device("cpu"), backend="gloo")
    return train(ctx, RunConfig.from_dict(cfg), resume=False).model_digest


def peer_digest() -> str:
    """The job trained directly (no service, no kill, no checkpoints: they do not change the maths)."""
    from bench._common import spawn
    from service.schemas import JobSpec
    from training.config.layout import Layout

    spec = {k: v for k, v in SPEC.items() if k not in ("faults", "checkpoint")}
    cfg = JobSpec.model_validate(spec).to_run_config(Layout(dp=DP), None)
    return str(spawn(DP, _digest_rank, (cfg.to_dict(),)))


def database(kind: str, home: Path) -> tuple[str, Callable[[], None]]:
    """A fresh database URL and its clean-up."""
    if kind == "sqlite":
        return f"sqlite:///{home / 'lattice.db'}", lambda: None
    from sqlalchemy import create_engine, text

    base = os.environ.get("LATTICE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
    schema = f"bench_failover_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        conn.commit()

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            conn.commit()
        admin.dispose()

    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}", drop


class Serve:
    def __init__(self, role: str, env: dict[str, str], log: Path, port: int = 0) -> None:
        self.role, self.log = role, log
        args = [sys.executable, "-m", "service", "serve", "--role", role]
        if port:
            args += ["--port", str(port)]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def run(kind: str, root: Path, ray_address: str | None = None) -> dict[str, Any]:
    """One failover; `ray_address`: an existing cluster (the tests'), else an embedded one of its own."""
    from training.parallel.dist import free_port
    from workers.cluster import start_embedded_cluster

    home = root / "home"
    home.mkdir(parents=True)
    url, drop = database(kind, home)
    cluster = None if ray_address else start_embedded_cluster(
        racks=1, nodes_per_rack=2, gpus_per_node=4, temp_dir=tempfile.mkdtemp(prefix="lat-fo-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")} | {
        "LATTICE_HOME": str(home), "LATTICE_DATABASE_URL": url,
        "LATTICE_RAY_ADDRESS": ray_address or cluster.address,  # type: ignore[union-attr]
        "LATTICE_FAULT_INJECTION": "true", "LATTICE_SCHEDULER_INTERVAL_S": "0.3", "LATTICE_LOG_LEVEL": "info",
    }
    port = free_port()
    procs: list[Serve] = []
    try:
        procs.append(Serve("api", env, root / "api.log", port))
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthz_up(base), 120, "the API")
        headers = {"Authorization": f"Bearer {(home / 'token').read_text().strip()}"}
        api = httpx.Client(base_url=base, headers=headers, timeout=30)

        def leader() -> str | None:
            return api.get("/v1/cluster").json()["scheduler"]["leader"]

        first = Serve("scheduler", env, root / "scheduler-1.log")
        procs.append(first)
        wait_for(lambda: (leader() or "").endswith(f":{first.proc.pid}"), 120, "the first scheduler to lead")
        second = Serve("scheduler", env, root / "scheduler-2.log")
        procs.append(second)
        wait_for(lambda: "Lattice scheduler running" in second.log.read_text(), 120, "the standby")
        job_id = api.post("/v1/jobs", json=SPEC).json()["id"]

        def events() -> list[dict[str, Any]]:
            return api.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}).json()["items"]

        wait_for(lambda: any(e["type"] == "checkpoint" for e in events()), 300, "a stored checkpoint")
        killed_step = api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"]
        os.kill(first.proc.pid, signal.SIGKILL)
        killed_at = time.time()
        first.proc.wait(30)  # reap it, as its supervisor would: a zombie's pid still answers kill(pid, 0)
        wait_for(lambda: (leader() or "").endswith(f":{second.proc.pid}"), 60, "the standby to lead")
        since = api.get("/v1/cluster").json()["scheduler"]["since"]  # when its term began
        leading_s = datetime.fromisoformat(since).timestamp() - killed_at
        reattached = wait_for(lambda: next((e for e in events() if e["type"] == "reattached"), None), 120,
                              "the new leader's first reconcile")
        reconcile_s = datetime.fromisoformat(reattached["time"]).timestamp() - killed_at
        job = wait_for(lambda: (lambda j: j if j["state"] in ("succeeded", "failed", "cancelled") else None)(
            api.get(f"/v1/jobs/{job_id}").json()), 600, "the job to finish")
        final = events()
        types = [e["type"] for e in final]
        starts = [e for e in final if e["type"] == "state" and e["payload"]["to"] == "starting"]
        return {"state": job["state"], "digest": (job.get("result") or {}).get("model_digest"),
                "killed_step": killed_step, "leading_s": leading_s, "reconcile_s": reconcile_s,
                "recovers": types.count("recover"), "restarts": types.count("restart"),
                "starts": len(starts)}
    finally:
        for p in reversed(procs):
            p.stop()
        if cluster is not None:
            cluster.shutdown()
        drop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=("postgres", "sqlite"), default="postgres")
    args = parser.parse_args()
    peer = peer_digest()
    with tempfile.TemporaryDirectory(prefix="lattice-failover-") as tmp:
        r = run(args.db, Path(tmp))
    same = r["digest"] == peer
    print(f"failover ({args.db}): leader SIGKILLed at step {r['killed_step']} of {STEPS}")
    print(f"  kill -> standby holds the lease:      {r['leading_s']:.2f} s")
    print(f"  kill -> new leader's first reconcile: {r['reconcile_s']:.2f} s (the job's `reattached` event)")
    print(f"  job {r['state']}; started {r['starts']}x, recovered {r['recovers']}x, ranks restarted "
          f"{r['restarts']}x")
    print(f"  final digest {'==' if same else '!='} the run without the kill ({r['digest']} vs {peer})")


if __name__ == "__main__":
    main()
