"""The one-GPU proof run: is the engine as fast and as small on a real GPU as the planner says?

    python -m bench.gpu_check                      # report to $OUT/gpu_check.md (or ./gpu_check.md)
    python bench/gpu_check.py --out report.md      # the same, from anywhere in the checkout

On one CUDA GPU, in under 8 minutes (`--budget-s`, default 420 s for calibration and training,
then the GPU tests get what is left of 8 minutes):
  1. calibrates the GPU (training.calibration: matmul FLOP/s over a grid of shapes in bf16 and fp32,
     causal SDPA, memory bandwidth by a large copy) into a hardware profile for the planner;
  2. trains a ~1.2B-parameter dense model (Llama 3.2 1B's shape) at sequence 2048 in bf16 with fp32
     master weights and AdamW state (train.precision bf16_fp32_adam), one rank, through the engine's
     Trainer, in six layouts: recompute none / selective / full x micro-batch 2 or 4 (global batch 8);
  3. prints per layout the planner's predicted step time (catalogue and calibrated), MFU and memory
     next to the measured ones (median step after warm-up; torch.cuda.max_memory_allocated) and their
     ratios, against the targets: best layout >= 40% MFU, memory within 10% of the plan, step time
     within 25% of the calibrated prediction;
  4. runs the engine's CUDA tests (`pytest -m gpu -q`) and adds their summary.
Everything goes to one markdown file. Without CUDA it exits 2 with a one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
           "run it on a machine with one GPU")
TOTAL_BUDGET_S = 480.0  # the whole run, pytest included
SEQ = 2048
GLOBAL_BATCH = 8
LAYOUTS: tuple[tuple[str, int], ...] = tuple((r, m) for r in ("none", "selective", "full") for m in (2, 4))
TARGET_MFU, TARGET_MEMORY, TARGET_STEP = 0.40, 0.10, 0.25  # issue 19's targets on the H200


@dataclass
class LayoutResult:
    """One layout: the planner's numbers and, when it ran, the measured ones."""

    recompute: str
    micro_batch: int
    num_microbatches: int
    predicted_s: float | None = None  # the catalogue's curves
    calibrated_s: float | None = None  # with this GPU's measured profile
    predicted_mfu: float | None = None
    plan_memory: float | None = None  # memory_per_gpu_bytes total - reserve: what the allocator holds
    measured_s: float | None = None
    measured_mfu: float | None = None
    peak_memory: float | None = None  # torch.cuda.max_memory_allocated
    flops_per_step: float | None = None  # model FLOPs as the planner counts them (MFU, not HFU)
    plan_terms: dict[str, float] = field(default_factory=dict)  # the plan's memory_per_gpu_bytes
    measured_terms: dict[str, float] = field(default_factory=dict)  # the engine's account (Trainer.memory)
    losses: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def label(self) -> str:
        return f"recompute={self.recompute} mbs={self.micro_batch} x{self.num_microbatches}"

    @property
    def best_prediction(self) -> float | None:
        """The calibrated prediction, else the catalogue's."""
        return self.calibrated_s if self.calibrated_s is not None else self.predicted_s

    def layout(self) -> Any:
        from training.config.layout import Layout

        return Layout(micro_batch_size=self.micro_batch, num_microbatches=self.num_microbatches,
                      recompute=self.recompute)


# ---- formatting (pure: tested on fake numbers) -------------------------------------------------------
def ratio(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or predicted <= 0:
        return None
    return measured / predicted


def _f(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, fmt)


def layout_table(rows: Sequence[LayoutResult]) -> list[str]:
    """The per-layout markdown table: predicted vs measured step time, MFU and peak memory."""
    gib = 2.0**30
    out = ["| layout | predicted s (catalogue) | predicted s (calibrated) | measured s | measured/calibrated "
           "| MFU predicted | MFU measured | plan GiB (allocated) | peak GiB | peak/plan | note |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.label, _f(r.predicted_s, ".3f"), _f(r.calibrated_s, ".3f"), _f(r.measured_s, ".3f"),
                 _f(ratio(r.measured_s, r.best_prediction), ".2f"), _f(r.predicted_mfu, ".1%"),
                 _f(r.measured_mfu, ".1%"), _f(r.plan_memory, ".1f", gib), _f(r.peak_memory, ".1f", gib),
                 _f(ratio(r.peak_memory, r.plan_memory), ".2f"), r.error or ""]
        out.append("| " + " | ".join(cells) + " |")
    return out


MEMORY_TERMS = ("params", "grads", "optimizer", "activations")


def memory_table(rows: Sequence[LayoutResult]) -> list[str]:
    """Per layout and term, the plan's bytes beside the engine's own account of its first step."""
    gib = 2.0**30
    out = ["| layout | term | plan GiB | measured GiB | measured/plan |", "|---|---|---|---|---|"]
    for r in rows:
        if not r.measured_terms:
            continue
        for term in MEMORY_TERMS:
            plan, got = r.plan_terms.get(term), r.measured_terms.get(term)
            out.append(f"| {r.label} | {term} | {_f(plan, '.2f', gib)} | {_f(got, '.2f', gib)} "
                       f"| {_f(ratio(got, plan), '.2f')} |")
    return out if len(out) > 2 else ["(no memory account: the engine reported none)"]


def verdicts(rows: Sequence[LayoutResult]) -> list[str]:
    """One line per target: met or not, with the number it was judged on."""
    ran = [r for r in rows if r.measured_s is not None]
    if not ran:
        return ["- no layout ran: no verdict"]
    best = max(ran, key=lambda r: r.measured_mfu or 0.0)
    lines = [f"- best layout {best.label}: MFU {_f(best.measured_mfu, '.1%')} "
             f"({'meets' if (best.measured_mfu or 0.0) >= TARGET_MFU else 'misses'} >= {TARGET_MFU:.0%})"]
    mem = [(r, ratio(r.peak_memory, r.plan_memory)) for r in ran]
    worst_mem = max(mem, key=lambda x: abs((x[1] or 1.0) - 1.0))
    ok_mem = all(x is not None and abs(x - 1.0) <= TARGET_MEMORY for _, x in mem)
    lines.append(f"- peak memory / plan: worst {_f(worst_mem[1], '.2f')} ({worst_mem[0].label}); "
                 f"{'all within' if ok_mem else 'not all within'} {TARGET_MEMORY:.0%}")
    step = [(r, ratio(r.measured_s, r.best_prediction)) for r in ran]
    worst_step = max(step, key=lambda x: abs((x[1] or 1.0) - 1.0))
    ok_step = all(x is not None and abs(x - 1.0) <= TARGET_STEP for _, x in step)
    lines.append(f"- measured / predicted step time (after calibration): worst {_f(worst_step[1], '.2f')} "
                 f"({worst_step[0].label}); {'all within' if ok_step else 'not all within'} "
                 f"{TARGET_STEP:.0%}")
    return lines


def calibration_lines(doc: dict[str, Any] | None) -> list[str]:
    """The calibration in a few lines: bf16 matmul TFLOP/s by shape, attention, memory bandwidth."""
    if not doc:
        return ["calibration: not available"]
    out = ["| m x n x k | bf16 TFLOP/s | fp32 TFLOP/s |", "|---|---|---|"]
    fp32 = {(int(m), int(n), int(k)): rate for m, n, k, rate in doc.get("matmul", {}).get("fp32", [])}
    for m, n, k, rate in doc.get("matmul", {}).get("bf16", []):
        out.append(f"| {int(m)} x {int(n)} x {int(k)} | {rate / 1e12:.1f} | "
                   f"{_f(fp32.get((int(m), int(n), int(k))), '.1f', 1e12)} |")
    att = doc.get("attention") or []
    if att:
        best = max(att, key=lambda p: p[2])
        out.append(f"\ncausal SDPA fwd+bwd: best {best[2] / 1e12:.1f} TFLOP/s (seq {int(best[0])}, head_dim "
                   f"{int(best[1])})")
    out.append(f"memory bandwidth (copy, read + write): {doc.get('memory_bw', 0.0) / 1e9:.0f} GB/s")
    return out


def format_report(meta: dict[str, Any], calibration: dict[str, Any] | None, rows: Sequence[LayoutResult],
                  tests: str, profiled: Sequence[str] = ()) -> str:
    """The whole report as markdown."""
    lines = [f"# gpu_check: {meta.get('device', '?')}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "## Calibration", "", *calibration_lines(calibration), "",
              f"## Training: seq {SEQ}, global batch {GLOBAL_BATCH}, bf16_fp32_adam",
              "", *layout_table(rows), "", "## Memory by term (the engine's account of its first step)", "",
              *memory_table(rows), "", "## Against the targets", "", *verdicts(rows), "",
              "## pytest -m gpu", "", "```", tests.strip() or "(not run)", "```", ""]
    if profiled:
        lines += ["## One profiled step (torch.profiler)", "", *profiled, ""]
    return "\n".join(lines)


def report_path(out: str | None) -> Path:
    """--out, else $OUT/gpu_check.md when OUT is set, else ./gpu_check.md."""
    if out:
        return Path(out)
    folder = os.environ.get("OUT")
    return Path(folder) / "gpu_check.md" if folder else Path("gpu_check.md")


# ---- measuring (CUDA) ------------------------------------------------------------------------------------
def model_1b() -> Any:
    """Llama 3.2 1B's shape (1.24B parameters, tied embeddings) at sequence 2048."""
    from training.config.spec import ModelSpec

    return ModelSpec(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq_len=SEQ,
                     tied_embeddings=True, rope_theta=500000.0, name="llama3.2-1b-shape")


def planner_gpu(device_name: str) -> str:
    """The planner's catalogue name for a CUDA device name (H100 when unknown: said in the report)."""
    known = (("H200", "H200-141GB"), ("H100", "H100-80GB"), ("A100", "A100-80GB"), ("B200", "B200"))
    for family, name in known:
        if family in device_name:
            return name
    return "H100-80GB"


def calibrate_gpu() -> dict[str, Any] | None:
    """The profile `lattice calibrate` measures on this GPU (its CUDA grid), without the collectives
    (one GPU has no second rank to send to)."""
    import torch

    from training.calibration import Grid, calibrate

    grid = Grid.for_device(torch.device("cuda", torch.cuda.current_device()))
    return calibrate("gpu-check", dataclasses.replace(grid, collectives=False))


def predict(rows: Sequence[LayoutResult], gpu_type: str, calibration: dict[str, Any] | None) -> list[str]:
    """Fill the planner's predictions in; returns notes (a profile the planner refused, ...)."""
    from service.planner import ClusterSpec, PlannerError, TrainSpec, evaluate
    from service.planner.efficiency import HardwareProfile

    notes: list[str] = []
    profile = None
    if calibration is not None:
        try:
            profile = HardwareProfile.from_dict(calibration)
        except ValueError as e:
            notes.append(f"calibrated profile refused: {e}")
    train = TrainSpec(global_batch=GLOBAL_BATCH, seq_len=SEQ, precision="bf16_fp32_adam")
    for r in rows:
        layout = r.layout()
        try:
            plan = evaluate(model_1b(), train, ClusterSpec(gpu_type, 1), layout)
        except PlannerError as e:
            r.error = f"planner: {e}"
            continue
        r.predicted_s, r.predicted_mfu, r.flops_per_step = plan.step_time_s, plan.mfu, plan.flops_per_step
        # What max_memory_allocated can see: the plan without its reserve (CUDA context, NCCL buffers,
        # allocator fragmentation), the loss backward's transient included.
        r.plan_memory = float(plan.memory_per_gpu_bytes["total"] - plan.memory_per_gpu_bytes["reserve"])
        r.plan_terms = {k: float(v) for k, v in plan.memory_per_gpu_bytes.items()}
        if profile is not None:
            calibrated = evaluate(model_1b(), train, ClusterSpec(gpu_type, 1, profile=profile), layout)
            r.calibrated_s = calibrated.step_time_s
    return notes


def run_config(r: LayoutResult, steps: int, compile_on: bool = False, model: Any = None) -> Any:
    """The engine's RunConfig of one layout (default model: `model_1b`), bf16 with fp32 masters."""
    from training.config.run import OptimConfig, RunConfig

    return RunConfig(model=model or model_1b(), layout=r.layout(), steps=steps, seed=0,
                     optim=OptimConfig(lr=3e-4), precision="bf16_fp32_adam", compile=compile_on)


def measure(r: LayoutResult, ctx: Any, peak_flops: float, steps: int, compile_on: bool,
            model: Any = None) -> None:
    """Train `steps` steps of one layout (default model: `model_1b`); the median step after two warm-up
    steps and, on CUDA, the allocator's peak. Runs on CPU too (the tests use a small model)."""
    import torch

    from training.train import Trainer

    cuda = ctx.device.type == "cuda"
    cfg = run_config(r, steps + 2, compile_on, model)
    trainer = None
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        trainer = Trainer(ctx, cfg)
        times = []
        for step in range(1, steps + 3):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, _ = trainer.train_step(step)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            r.losses.append(round(loss, 4))
        r.measured_s = statistics.median(times[2:])
        r.peak_memory = float(torch.cuda.max_memory_allocated()) if cuda else None
        account = getattr(trainer, "memory", None)  # training.parallel.memory.MemoryAccount, first step
        if account is not None:
            r.measured_terms = {k: float(v) for k, v in account.to_dict().items() if v is not None}
        if r.flops_per_step is not None:  # the planner's MFU definition, on the measured time
            r.measured_mfu = r.flops_per_step / (r.measured_s * peak_flops)
    except torch.cuda.OutOfMemoryError:
        r.error, r.peak_memory = "out of memory", float(torch.cuda.max_memory_allocated())
    except Exception as e:  # noqa: BLE001 - one layout's failure is reported, the others still run
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    finally:
        if trainer is not None:
            trainer.close()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run_gpu_tests(timeout_s: float, target: str = "tests/gpu") -> str:
    """`pytest -m gpu -q` in the checkout; its last lines (the summary)."""
    # tests/gpu alone: collecting the whole suite needs the service's packages (FastAPI, Ray, ...), which a
    # GPU image need not have; the engine's CUDA tests need torch and the checkout.
    cmd = [sys.executable, "-m", "pytest", target, "-m", "gpu", "-q", "-p", "no:randomly"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(30.0, timeout_s))
    except subprocess.TimeoutExpired:
        return f"pytest -m gpu: timed out after {timeout_s:.0f} s"
    return "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:]) + f"\n(exit {done.returncode})"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="report file (default $OUT/gpu_check.md, else ./gpu_check.md)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (after 2 warm-up steps)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for calibration and training")
    p.add_argument("--total-s", type=float, default=TOTAL_BUDGET_S, help="seconds in all, tests too")
    p.add_argument("--compile", action="store_true", help="train with train.compile (torch.compile)")
    p.add_argument("--no-tests", action="store_true", help="skip `pytest -m gpu`")
    p.add_argument("--profile", action="store_true",
                   help="profile one step of the no-recompute layouts (bench/gpu_profile.py)")
    p.add_argument("--tests", default="tests/gpu", help="what `pytest -m gpu` runs (a folder or a node id)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from training.config.hardware import find_gpu
    from training.parallel.dist import free_port, init_distributed, shutdown

    device_name = torch.cuda.get_device_name(0)
    gpu_type = planner_gpu(device_name)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    meta: dict[str, Any] = {
        "device": device_name, "planner gpu type": gpu_type, "date": now, "host": platform.node(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "compile": args.compile,
        "model": "Llama 3.2 1B shape (16 x 2048, 32 heads / 8 kv, ffn 8192, vocab 128256, tied)"}  # fmt: skip
    rows = [LayoutResult(rec, mbs, GLOBAL_BATCH // mbs) for rec, mbs in LAYOUTS]
    calibration, profiled = None, []
    try:
        calibration = calibrate_gpu()
        meta["calibration s (target < 10 on a GPU)"] = calibration["meta"]["seconds"]
        meta["calibration phases s"] = calibration["meta"].get("phases")
        if os.environ.get("OUT"):  # the whole profile document, for the planner's tests and docs
            import json

            Path(os.environ["OUT"], "gpu_profile.json").write_text(json.dumps(calibration, indent=1))
    except Exception as e:  # noqa: BLE001 - the training numbers are still worth having
        meta["calibration error"] = f"{type(e).__name__}: {e}"
    for note in predict(rows, gpu_type, calibration):
        meta.setdefault("notes", []).append(note)
    ctx = init_distributed(0, 1, "127.0.0.1", free_port(), timeout_s=600)
    try:
        gpu = find_gpu(gpu_type)
        assert gpu is not None
        for r in rows:
            if time.monotonic() - started > args.budget_s:
                r.error = "skipped: time budget"
                continue
            measure(r, ctx, gpu.peak_flops, args.steps, args.compile)
            print(f"{r.label}: {_f(r.measured_s, '.3f')} s/step, MFU {_f(r.measured_mfu, '.1%')}, "
                  f"peak {_f(r.peak_memory, '.1f', 2.0**30)} GiB {r.error or ''}", flush=True)
        if args.profile:
            from bench.gpu_profile import profile_layout, profile_lines

            profiled = profile_lines([profile_layout(r, ctx) for r in rows if r.recompute == "none"])
    finally:
        shutdown()
    meta["seconds (calibration + training)"] = round(time.monotonic() - started, 1)
    tests = "" if args.no_tests else run_gpu_tests(args.total_s - (time.monotonic() - started), args.tests)
    report = format_report(meta, calibration, rows, tests, profiled)
    path = report_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)
    print(report)
    print(f"report written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:  # `python bench/gpu_check.py` from anywhere
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
