"""Silent-data-corruption checks of the train loop: what they catch, how fast, what they cost.

    python -m bench.sdc                       # 60 flips, 200 clean steps, overhead; DP 3, gloo
    python -m bench.sdc --full                # 100 flips, 1,000 clean steps
    python -m bench.sdc --abft                # also the opt-in linear-layer checksums (integrity.abft)

1. Bit flips: `--flips` runs of `--steps` steps, each with one flip at a random step (after the
   checks' warm-up), on a random rank, at a random element and a random bit: exponent (23-30),
   mantissa (0-22) or sign (31) of the float32, in a random parameter (after the optimizer step,
   on one replica), a random rank's local gradient (before the DP reduction) or a rank's reduced
   bucket (after the reduction: corruption in the communication). Reported by target and class:
   detection rate, whether the culprit rank was named, latency in steps (0 = caught in the step it
   happened) and the check that caught it. An undetected flip is compared with the clean run's
   final weights: within the repo's run-to-run tolerance (allclose atol = rtol = 1e-4, what a
   replan to another layout keeps, tests/faults/test_replan_layouts.py) it was harmless.
2. False positives: `--clean-steps` steps without faults; every failed check is a false positive.
3. Overhead: the checks' own time inside the steps (fingerprint and vote, loss checks, local
   gradient norms, the gradient checksum and peer outliers, ABFT with --abft) against the step,
   and the whole-step A/B against a run with every check off, on a larger model (`--hidden`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from bench._common import machine, spawn, table
from training.config.layout import Layout
from training.config.run import IntegrityConfig, RunConfig
from training.config.spec import ModelSpec

BIT_CLASSES = {"sign": [31], "exponent": list(range(23, 31)), "mantissa": list(range(0, 23))}
TARGETS = ("param", "grad", "reduce")
TOLERANCE = 1e-4  # run-to-run: allclose(atol=rtol=1e-4), what a replan keeps (test_replan_layouts.py)


def _flip_plan(n: int, steps: int, world: int, names: list[tuple[str, int]], seed: int) -> list[dict]:
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        cls = ("exponent", "mantissa", "sign")[i % 3]
        name, numel = rng.choice(names)
        plan.append({"cls": cls, "bit": rng.choice(BIT_CLASSES[cls]), "target": TARGETS[(i // 3) % 3],
                     "rank": rng.randrange(world), "step": rng.randint(4, steps - 1), "name": name,
                     "index": rng.randrange(numel)})
    return plan


def _deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """(max |a - b| / (atol + rtol |b|) over every element, within the run-to-run tolerance)."""
    worst = 0.0
    for k, v in b.items():
        d = ((a[k].double() - v.double()).abs() / (TOLERANCE + TOLERANCE * v.double().abs())).max().item()
        worst = max(worst, d if d == d else float("inf"))
    return worst, worst <= 1.0


class _Timer:
    """Wraps methods to add their wall time per component (the checks' own time inside the steps)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, component: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[component] = self.seconds.get(component, 0.0) + time.perf_counter() - t

        self._saved.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()


def _bench(rank: int, world: int, args: dict) -> dict[str, Any]:
    from training.model.transformer import Transformer
    from training.parallel.dist import DistContext

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    spec = ModelSpec(layers=2, hidden=32, heads=2, vocab=64, seq_len=16)
    cfg = RunConfig(model=spec, layout=Layout(dp=world), steps=args["steps"], seed=1,
                    integrity=IntegrityConfig(abft=args["abft"]))
    names = [(n, p.numel()) for n, p in Transformer(spec).named_parameters()]
    out: dict[str, Any] = {"outcomes": [], "false_positives": None}
    if not args["overhead_only"]:
        out["outcomes"] = _flips(ctx, cfg, names, args)
        out.update(_false_positives(ctx, replace(cfg, steps=args["clean_steps"])))
    out.update(_overhead(ctx, world, args))
    return out


def _hooks(rank: int, flips: list[Any], stop: bool) -> Any:
    from training.integrity.injection import BitFlipInjector
    from training.train import Action, TrainHooks

    class Watch(TrainHooks):
        def __init__(self) -> None:
            self.injector = BitFlipInjector(flips, rank) if flips else None
            self.errors: list[tuple[str, int, list[int]]] = []

        def on_integrity_error(self, error: Any) -> Action:
            self.errors.append((error.kind, error.step, list(error.ranks)))
            return Action.STOP if stop else Action.CONTINUE

    return Watch()


def _flips(ctx: Any, cfg: RunConfig, names: list[tuple[str, int]], args: dict) -> list[dict]:
    from training.integrity.injection import BitFlip

    clean = _run_state(ctx, cfg, _hooks(ctx.rank, [], True))
    outcomes = []
    for f in _flip_plan(args["flips"], args["steps"], ctx.world_size, names, args["seed"]):
        flip = BitFlip(step=f["step"], rank=f["rank"], target=f["target"], name=f["name"], index=f["index"],
                       bit=f["bit"])
        hooks = _hooks(ctx.rank, [flip], True)
        state = _run_state(ctx, cfg, hooks)
        detected = hooks.errors[0] if hooks.errors else None
        outcome = {**f, "detected": detected is not None}
        if detected:
            outcome.update(kind=detected[0], latency=detected[1] - f["step"], named=detected[2])
        else:
            outcome["deviation"], outcome["harmless"] = _deviation(state, clean)
        outcomes.append(outcome)
    return outcomes


def _false_positives(ctx: Any, cfg: RunConfig) -> dict[str, Any]:
    from training.integrity.abft import GradABFT
    from training.train import train

    hooks = _hooks(ctx.rank, [], False)
    worst: list[float] = []  # ABFT: each clean step's largest |difference| / tolerance (<= 1 passes)
    verify = GradABFT.verify

    def recording(self: GradABFT, step: int, rank: int) -> Any:
        error = verify(self, step, rank)
        worst.append(self.worst)
        return error

    GradABFT.verify = recording  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        train(ctx, cfg, hooks, resume=False)
    finally:
        GradABFT.verify = verify  # type: ignore[method-assign]
    seconds = time.perf_counter() - t0
    return {"false_positives": hooks.errors, "clean_steps": cfg.steps, "clean_seconds": seconds,
            "abft_worst": max(worst) if worst else None}


def _overhead(ctx: Any, world: int, args: dict) -> dict[str, Any]:
    import training.train as train_module
    from training.integrity.abft import GradABFT
    from training.integrity.gradient import GradientAudit
    from training.model.transformer import Transformer
    from training.train import Trainer, TrainHooks, train

    big = ModelSpec(layers=args["layers"], hidden=args["hidden"], heads=8, vocab=512, seq_len=args["seq"])
    big_cfg = RunConfig(model=big, layout=Layout(dp=world, micro_batch_size=args["batch"]),
                        steps=args["overhead_steps"], seed=2, integrity=IntegrityConfig(abft=args["abft"]))
    no_checks = IntegrityConfig(fingerprint_every=0, loss_spike_factor=1e30, check_finite=False)
    timings: dict[str, list[float]] = {}

    class Timed(TrainHooks):
        def __init__(self, checks: bool) -> None:
            self.times: list[float] = []
            if not checks:
                self.audit = None

        def on_step(self, info: Any) -> None:
            self.times.append(info.step_time_s)

    # The checks' own time, measured inside the "on" runs: the A/B difference of whole steps is
    # within the noise of a shared 2-core machine. The fingerprint's 4 words ride on the step's loss
    # all-gather; check_local_grads includes the ABFT comparison, _accumulate its checksum products.
    timer = _Timer()
    for label in ("off", "on", "off", "on"):  # interleaved, so drift hits both alike
        hooks = Timed(label == "on")
        if label == "on":
            timer.wrap(Trainer, "check_integrity", "loss checks + vote")
            timer.wrap(train_module, "param_fingerprint", "fingerprint")
            # DP >= 3 or ZeRO >= 1: every rank agrees before the update whether to re-run the step
            timer.wrap(train_module, "settle_before_update", "re-run flag (before the update)")
            timer.wrap(Trainer, "check_local_grads", "local norm (+ ABFT compare)")
            timer.wrap(GradientAudit, "record", "bucket checksums")
            timer.wrap(GradientAudit, "verify", "checksum + peer outliers")
            timer.wrap(GradABFT, "_on_forward", "ABFT input norms (forward)")
            timer.wrap(GradABFT, "_accumulate", "ABFT checksums (backward)")
        try:
            run_cfg = big_cfg if label == "on" else replace(big_cfg, integrity=no_checks)
            train(ctx, run_cfg, hooks, resume=False)
        finally:
            timer.restore()
        timings.setdefault(label, []).extend(hooks.times[2:])  # drop warm-up steps
    per_step = {k: v / (2 * big_cfg.steps) for k, v in timer.seconds.items()}  # every step, warm-up too
    return {"step_off": statistics.median(timings["off"]), "step_on": statistics.median(timings["on"]),
            "overhead_params": sum(p.numel() for p in Transformer(big).parameters()),
            "check_per_step": per_step}


def _run_state(ctx: Any, cfg: RunConfig, hooks: Any) -> dict[str, torch.Tensor]:
    """Train and return rank 0's final full model state (the digest's tensors)."""
    from training.train import Trainer, train

    captured: dict[str, Any] = {}
    original = Trainer.digest

    def digest(self: Any) -> str:
        captured["state"] = {k: v.detach().clone() for k, v in self.full_state().items()}
        return original(self)

    Trainer.digest = digest  # type: ignore[method-assign]
    try:
        train(ctx, cfg, hooks, resume=False)
    finally:
        Trainer.digest = original  # type: ignore[method-assign]
    return captured["state"]


WHY = {
    "grad": "without --abft: the flip keeps the gradient's scale against the DP peers (mantissa, sign, an "
            "exponent bit that halves or doubles an element); with --abft: the change is below the "
            "checksum's rounding bound (a low mantissa bit)",
    "reduce": "the change is below the rounding bound of the checksum (a low bit of a small element)",
    "param": "(param flips change the replica's fingerprint exactly; none should be missed)",
}


def _report_flips(outcomes: list[dict], steps: int) -> None:
    print(f"\n## {len(outcomes)} random bit flips ({steps}-step runs, tiny GPT)")
    rows = []
    for target in TARGETS:
        for cls in ("exponent", "mantissa", "sign"):
            group = [o for o in outcomes if o["target"] == target and o["cls"] == cls]
            if not group:
                continue
            hit = [o for o in group if o["detected"]]
            named = [o for o in hit if o["named"] == [o["rank"]]]
            missed = [o for o in group if not o["detected"]]
            harmful = [o for o in missed if not o["harmless"]]
            lat = [o["latency"] for o in hit]
            rows.append([f"{target} {cls}", len(group), f"{len(hit)}/{len(group)}",
                         f"{len(named)}/{len(hit)}" if hit else "-", f"{len(harmful)}/{len(missed)}",
                         max(lat) if lat else "-", ", ".join(sorted({o["kind"] for o in hit})) or "-"])
    print(table(["class", "flips", "detected", "culprit named", "missed & beyond tol.", "max latency",
                 "detected by"], rows))
    missed = [o for o in outcomes if not o["detected"]]
    if missed:
        print(f"\nundetected ({len(missed)}): target, bit, parameter[index] -> max deviation in units of "
              f"the run-to-run tolerance (<= 1: harmless)")
        for o in sorted(missed, key=lambda o: -o["deviation"]):
            where = f"{o['name']}[{o['index']}] step {o['step']}"
            print(f"  {o['target']:6s} bit {o['bit']:2d} ({o['cls']}) {where} -> {o['deviation']:.2g}")
        for target in sorted({o["target"] for o in missed}):
            print(f"  why ({target}): {WHY[target]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=3, help="DP replicas (>= 3 for a majority vote)")
    parser.add_argument("--full", action="store_true", help="100 flips and 1,000 clean steps")
    parser.add_argument("--flips", type=int, default=None, help="default 60 (100 with --full)")
    parser.add_argument("--steps", type=int, default=8, help="steps per flip run")
    parser.add_argument("--clean-steps", type=int, default=None, help="default 200 (1,000 with --full)")
    parser.add_argument("--abft", action="store_true", help="opt-in linear-layer gradient checksums")
    parser.add_argument("--overhead-steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per replica in the overhead run")
    parser.add_argument("--seq", type=int, default=128, help="sequence length in the overhead run")
    parser.add_argument("--overhead-only", action="store_true", help="only the overhead (e.g. a larger "
                        "shape: --hidden 1024 --layers 1 --seq 256)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    flips = a.flips if a.flips is not None else (100 if a.full else 60)
    clean = a.clean_steps if a.clean_steps is not None else (1000 if a.full else 200)
    args = {"flips": flips, "clean_steps": clean, **{k: getattr(a, k) for k in (
        "steps", "overhead_steps", "hidden", "layers", "batch", "seed", "abft", "seq", "overhead_only")}}
    t0 = time.perf_counter()
    res = spawn(a.world, _bench, (args,), timeout_s=3600)
    print(f"# bench.sdc — {machine()}; DP {a.world} (gloo), abft {'on' if a.abft else 'off'}, "
          f"{time.perf_counter() - t0:.0f}s")
    if not a.overhead_only:
        _report_flips(res["outcomes"], a.steps)
        fps = res["false_positives"]
        print(f"\n## false positives: {len(fps)} in {res['clean_steps']} clean steps "
              f"({res['clean_seconds']:.0f}s){': ' + str(fps[:10]) if fps else ''}")
        if res["abft_worst"] is not None:
            print(f"ABFT margin: the largest clean |difference| / tolerance was {res['abft_worst']:.3f} "
                  "(rank 0; > 1 would be a false positive)")
    off, on = res["step_off"], res["step_on"]
    print(f"\n## overhead ({res['overhead_params'] / 1e6:.1f}M params, hidden {a.hidden}, {a.layers} layers, "
          f"seq {a.seq}, micro-batch {a.batch} per replica: {a.seq * a.batch} tokens per rank)")
    print(table(["checks", "median step (s)"], [["off", f"{off:.4f}"], ["on", f"{on:.4f}"]]))
    per = res["check_per_step"]
    print(table(["check", "ms per step", "share of the step"],
                [[k, f"{v * 1e3:.2f}", f"{100 * v / on:.2f}%"] for k, v in per.items()]))
    total = sum(per.values())
    abft = sum(v for k, v in per.items() if "ABFT" in k)  # check_local_grads is only the ABFT compare
    print(f"default checks {100 * (total - abft) / on:.2f}%, ABFT {100 * abft / on:.2f}% of the step")
    print(f"the checks' own time: {total * 1e3:.2f} ms per step = {100 * total / on:.2f}% of the step "
          "(target <= 2%)")
    print(f"whole-step A/B difference: {100 * (on - off) / off:+.2f}% (noise of a shared machine included)")


if __name__ == "__main__":
    main()
