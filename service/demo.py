"""The demo behind `make run`: start the embedded service, submit examples/demo.yaml, watch it, explain it.

    python -m service.demo            # then keeps serving until Ctrl-C (the CLI can talk to it)
    python -m service.demo --exit     # stops the service after the summary

The service is the real one (`service.runtime.Runtime`: migrations, an embedded Ray cluster of
2 racks x 2 nodes x 4 virtual GPUs, the scheduler, the HTTP API on uvicorn); the demo is only an
HTTP client of it. The summary shows the plan and its reasons, where every rank ran (by rack and
node), the loss at the start and at the end, and the throughput.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.tree import Tree

from service.cli.performance_views import perf_rows
from service.settings import Settings

DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
TERMINAL = ("succeeded", "failed", "cancelled")

console = Console(highlight=False)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Watch:
    """What the demo saw while the job ran."""

    submitted: float
    first_step_at: float | None = None
    finished_at: float | None = None
    tokens_per_s: list[float] = field(default_factory=list)
    job: dict[str, Any] = field(default_factory=dict)


def watch(client: httpx.Client, job_id: str, interval_s: float = 0.5) -> Watch:
    seen = Watch(submitted=time.monotonic())
    columns = (
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
        TextColumn("[cyan]{task.fields[state]}"), TimeElapsedColumn(),
    )
    last_step, said = 0, ""
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("demo", total=None, loss="-", tps="-", state="pending")
        while True:
            try:
                job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
            except httpx.HTTPError as e:
                progress.console.print(f"[yellow]poll failed: {e}; retrying")
                time.sleep(interval_s)
                continue
            p = job["progress"]
            if job["state"] in ("pending", "queued") and job.get("reason") not in (None, said, job["state"]):
                said = job["reason"]  # why it waits (e.g. the cluster's first hardware profile)
                progress.console.print(f"[dim]{said}")
            if p["step"] > last_step:
                if seen.first_step_at is None:
                    seen.first_step_at = time.monotonic()
                if p["tokens_per_s"]:
                    seen.tokens_per_s.append(p["tokens_per_s"])
                last_step = p["step"]
            progress.update(
                task, total=p["total_steps"] or None, completed=p["step"], state=job["state"],
                loss=f"{p['loss']:.4f}" if p["loss"] is not None else "-",
                tps=f"{p['tokens_per_s']:.0f}" if p["tokens_per_s"] else "-",
            )
            if job["state"] in TERMINAL:
                seen.finished_at = time.monotonic()
                seen.job = job
                return seen
            time.sleep(interval_s)


def print_plan(plan: dict[str, Any]) -> None:
    lay = plan["layout"]
    pred = plan.get("predicted") or {}
    console.rule("[bold]Plan")
    console.print(
        f"layout tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} cp={lay['cp']} zero={lay['zero_stage']} "
        f"micro-batch {lay['micro_batch_size']} x {lay['num_microbatches']} ({lay['schedule']})"
        + (", sequence parallel" if lay.get("sequence_parallel") else "")
    )
    if pred:
        console.print(
            f"predicted: {pred.get('step_time_s', 0) * 1e3:.1f} ms/step, MFU {pred.get('mfu', 0):.1%}, "
            f"{pred.get('tokens_per_s', 0):.0f} tokens/s on {plan['cluster']['num_gpus']} "
            f"{plan['cluster']['gpu_type']} GPUs"
        )
    for reason in plan.get("reasons") or []:
        console.print(f"  - {reason}")


def print_placement(placement: list[dict[str, Any]]) -> None:
    console.rule("[bold]Placement (read back from the rank actors)")
    tree = Tree("cluster")
    racks: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in placement:
        racks.setdefault(r["rack"], {}).setdefault(r.get("node_name") or r["node_id"][:12], []).append(r)
    for rack in sorted(racks):
        stages = sorted({r["pp"] for ns in racks[rack].values() for r in ns})
        branch = tree.add(f"[bold]rack {rack}[/bold]  (pipeline stage {', '.join(map(str, stages))})")
        for node in sorted(racks[rack]):
            ranks = sorted(racks[rack][node], key=lambda r: r["gpu"])
            leaf = branch.add(f"node {node}")
            for r in ranks:
                leaf.add(f"GPU {r['gpu']}: rank {r['rank']}  (pp={r['pp']} dp={r['dp']} tp={r['tp']})")
    console.print(tree)


def print_outcome(job: dict[str, Any], seen: Watch) -> None:
    console.rule("[bold]Outcome")
    result = job.get("result") or {}
    spec = job["spec"]
    if job["state"] != "succeeded":
        console.print(f"[red]job {job['state']}[/red]: {job.get('error')}")
        return
    console.print(
        f"loss: {result['loss_first']:.4f} at step {result['loss_first_step']} -> "
        f"{result['loss_last']:.4f} at step {result['final_step']}"
    )
    seq_len = (job["plan"] or {}).get("train", {}).get("seq_len") or 0
    tokens = spec["train"]["steps"] * spec["train"]["global_batch"] * seq_len
    table = Table(show_header=False, box=None)
    if seen.first_step_at is not None and seen.finished_at is not None:
        table.add_row("submit -> first step", f"{seen.first_step_at - seen.submitted:.1f} s")
        training = max(seen.finished_at - seen.first_step_at, 1e-9)
        table.add_row("first step -> done", f"{training:.1f} s")
    if seen.tokens_per_s:
        mean = sum(seen.tokens_per_s) / len(seen.tokens_per_s)
        table.add_row("throughput", f"{mean:.0f} tokens/s (mean over steps; {tokens} tokens in all)")
    if result.get("step_time_s"):
        table.add_row("last step time", f"{result['step_time_s'] * 1e3:.0f} ms")
    for name, text in perf_rows(job.get("performance")):  # as `lattice status` shows them
        table.add_row(name, text)
    if result.get("checkpoint"):
        ckpt = result["checkpoint"]
        table.add_row("final checkpoint", f"step {ckpt.get('step')}: {ckpt.get('path')}")
    table.add_row("restarts", str(job.get("attempt", 0)))
    table.add_row("model digest", str(result.get("model_digest")))
    console.print(table)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the demo's Ctrl-C path: the runtime (Ray, the scheduler) is stopped


def run_demo(spec_path: Path, *, exit_after: bool, port: int | None) -> int:
    from service.runtime import Runtime, ServiceStartError

    settings = Settings()
    if "log_level" not in settings.model_fields_set:  # the demo's console is the progress bar
        settings = settings.model_copy(update={"log_level": "warning"})
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = yaml.safe_load(spec_path.read_text())
    if port is None:
        port = settings.port if port_is_free(settings.host, settings.port) else 0
    with console.status("Starting Lattice: database, embedded Ray cluster "
                        f"({settings.embedded_racks} racks x {settings.embedded_nodes_per_rack} nodes x "
                        f"{settings.embedded_gpus_per_node} virtual GPUs), scheduler, API ..."):
        runtime = Runtime(settings)
        try:
            runtime.start()
        except ServiceStartError as e:
            console.print(f"[red]error:[/red] {e}")
            return 1
    signal.signal(signal.SIGTERM, _interrupt)  # after Ray's driver set its own: `kill` stops as Ctrl-C
    try:
        url = runtime.serve_in_thread(port)
        settings.server_file.write_text(url + "\n")
        console.print(f"Lattice is serving on {url}")
        if runtime.admin_token is not None and sys.stdout.isatty():
            console.print(f"Admin token (shown once; saved to {settings.token_path}, mode 0600):")
            console.print(runtime.admin_token, soft_wrap=True)
            token = runtime.admin_token
        elif runtime.admin_token is not None:  # a log, not a person: never write the secret there
            console.print(f"Admin token created and saved to {settings.token_path} (mode 0600)")
            token = runtime.admin_token
        else:
            console.print(f"Admin token: in {settings.token_path}")
            token = settings.token_path.read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            r = client.post("/v1/jobs", json=spec, headers={"Idempotency-Key": uuid.uuid4().hex})
            if r.status_code >= 400:
                console.print(f"[red]submit failed ({r.status_code}):[/red] {r.text}")
                return 1
            job = r.json()
            console.print(f"submitted {spec_path.name} as job {job['id']}")
            seen = watch(client, job["id"])
        job = seen.job
        print_plan(job["plan"])
        if job.get("placement"):
            print_placement(job["placement"])
        print_outcome(job, seen)
        if not exit_after:
            console.print(f"\nStill serving on {url} (try `lattice jobs`, `lattice status {job['id']}`); "
                          "Ctrl-C stops it.")
            stop = threading.Event()
            try:
                stop.wait()
            except KeyboardInterrupt:
                pass
        return 0 if job["state"] == "succeeded" else 1
    except KeyboardInterrupt:
        return 130
    finally:
        with console.status("Stopping Lattice ..."):
            runtime.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC, help="Job spec to submit (YAML).")
    parser.add_argument("--exit", action="store_true", help="Stop the service after the summary.")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port (default LATTICE_PORT, else a free one).")
    args = parser.parse_args(argv)
    return run_demo(args.spec, exit_after=args.exit, port=args.port)


if __name__ == "__main__":
    raise SystemExit(main())
