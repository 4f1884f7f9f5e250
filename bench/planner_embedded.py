"""Issue 16's target as written: the demo job and four other layouts of the demo model through a fresh
`lattice serve` on its embedded cluster (2 racks x 2 nodes x 4 virtual GPUs on this host), each job's
predicted step time against what it measured (median after warm-up, `performance` of GET /v1/jobs/ID).

    python -m bench.planner_embedded            # or: python bench/planner_accuracy.py --embedded

The service calibrates the node type in the background (profile v1: the quick grid on one node and the
collectives between two nodes); every job is planned from that one profile (LATTICE_PLANNER_FEEDBACK
off), one job at a time. The four fixed layouts exceed cpu-virtual's memory budget and are admitted with
`allow_unfit` (the home's admin token).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench._common import healthz_up, wait_for

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS: list[tuple[str, Any]] = [
    ("demo (parallelism: auto)", "auto"),
    ("DP 8", {"dp": 8}),
    ("TP 2 x DP 4", {"tp": 2, "dp": 4}),
    ("PP 2 x DP 4, 1F1B, m 2", {"pp": 2, "dp": 4, "schedule": "1f1b", "num_microbatches": 2}),
    ("ZeRO-3 DP 8", {"dp": 8, "zero_stage": 3}),
]


def spec(parallelism: Any, steps: int) -> dict[str, Any]:
    return {"name": "bench-planner", "model": {"preset": "demo"}, "data": {"kind": "synthetic", "seed": 0},
            "train": {"steps": steps, "global_batch": 8, "lr": 0.003, "seed": 0},
            "parallelism": parallelism, "resources": {"gpus": 8}, "allow_unfit": parallelism != "auto"}


def run(steps: int, root: Path, layouts: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    from training.parallel.dist import free_port

    home = root / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LATTICE_")} | {
        "LATTICE_HOME": str(home), "LATTICE_PLANNER_FEEDBACK": "false", "LATTICE_LOG_LEVEL": "info"}
    with open(root / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        wait_for(lambda: healthz_up(base), 300, "lattice serve")
        token = (home / "token").read_text().strip()
        api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        profile = wait_for(lambda: next(iter(api.get("/v1/cluster").json()["profiles"]), None), 300,
                           "the background calibration")
        print(f"# profile v{profile['version']}: all-reduce {_link(profile.get('all_reduce'))} within a "
              f"node, {_link(profile.get('inter_node_all_reduce'))} between nodes", flush=True)
        for name, parallelism in layouts:
            r = api.post("/v1/jobs", json=spec(parallelism, steps))
            if r.status_code >= 300:
                raise RuntimeError(f"{name}: submit answered {r.status_code}: {r.text}")
            job_id = r.json()["id"]
            with HealthzSampler(base) as api_ms:
                job = wait_for(lambda job_id=job_id: _finished(api.get(f"/v1/jobs/{job_id}").json()), 900,
                               f"job {name}")
            perf = job.get("performance") or {}
            pred = (perf.get("predicted") or {}).get("step_time_s")
            meas = (perf.get("measured") or {}).get("step_time_s")
            layout = (job.get("plan") or {}).get("layout", {})
            rows.append({"name": name, "state": job["state"], "pred": pred, "meas": meas,
                         "layout": layout, "load": os.getloadavg()[0]})
            print(_row(rows[-1]), flush=True)
            print(f"    GET /healthz while it ran: {api_ms.summary()}", flush=True)
            print(_terms(perf.get("terms") or []), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return rows


class HealthzSampler:
    """Times GET /healthz every `interval_s` in a thread while a job runs: how responsive the service
    stays while its ranks compute on the same cores."""

    def __init__(self, base: str, interval_s: float = 0.25) -> None:
        self.base, self.interval_s, self.ms = base, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as c:
            while not self._stop.wait(self.interval_s):
                t0 = time.perf_counter()
                c.get("/healthz")
                self.ms.append((time.perf_counter() - t0) * 1e3)

    def __enter__(self) -> HealthzSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> str:
        if not self.ms:
            return "no samples"
        ms = sorted(self.ms)
        p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        median = statistics.median(ms)
        return f"median {median:.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms ({len(ms)} requests)"


def _finished(job: dict[str, Any]) -> dict[str, Any] | None:
    return job if job["state"] in ("succeeded", "failed", "cancelled") else None


def _link(ar: dict[str, float] | None) -> str:
    return f"{ar['gbps']:.3g} GB/s + {ar['latency_us']:.0f} us" if ar else "- (catalogue)"


def _row(r: dict[str, Any]) -> str:
    if r["pred"] is None or r["meas"] is None:
        return f"{r['name']:28s} {r['state']}: no prediction or measurement"
    return (f"{r['name']:28s} {r['pred'] * 1e3:9.1f} {r['meas'] * 1e3:9.1f} {r['meas'] / r['pred']:6.2f}"
            f"   (load average {r['load']:.1f})")


def _terms(terms: list[dict[str, Any]]) -> str:
    """One line of the job's per-term predicted / measured ms (GET /v1/jobs/ID `performance.terms`)."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    return "    " + ", ".join(f"{t['name']} {ms(t.get('predicted_s'))}/{ms(t.get('measured_s'))}"
                              for t in terms)


def report(steps: int, only: list[int] | None = None) -> None:
    layouts = [LAYOUTS[i] for i in only] if only else LAYOUTS
    print(f"{'layout (8 ranks)':28s} {'pred ms':>9s} {'meas ms':>9s} {'ratio':>6s}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lat-pe-") as tmp:
        rows = run(steps, Path(tmp), layouts)
    within = sum(1 for r in rows if r["pred"] and r["meas"] and 0.75 <= r["meas"] / r["pred"] <= 1.25)
    print(f"# measured within +-25% of the prediction: {within}/{len(rows)} (target: all 5)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated indices into the layouts (0 = the demo)")
    args = ap.parse_args()
    report(args.steps, [int(i) for i in args.only.split(",") if i] or None)


if __name__ == "__main__":
    main()
