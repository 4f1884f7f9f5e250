"""Run one training job without Lattice's service:

    torchrun --nproc-per-node 8 -m training.run --spec job.yaml [--steps N] [--checkpoint-dir D]

The spec is a Lattice job yaml. Only what one run needs is read; the service's keys (name,
priority, resources, fault_tolerance) are ignored:

    model:        explicit ModelSpec fields (layers, hidden, heads, vocab, seq_len, ...)
    data:         {kind: synthetic | tokens, path, seed}
    train:        {steps, global_batch, lr, seed, dp_impl, weight_decay, grad_clip, compile, precision}
    parallelism:  an explicit layout dict (tp, pp, dp, zero_stage, micro_batch_size, ...)
    checkpoint:   {dir, every_steps, keep, async_save}

`model: {preset: ...}` and `parallelism: auto` need the service (its model catalogue and
planner) and are refused with a message saying so. Rank 0 logs progress and prints
`model_digest=<sha256>` at the end.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from training.config.layout import Layout, LayoutError
from training.config.run import CheckpointConfig, DataConfig, OptimConfig, RunConfig
from training.config.spec import ModelSpec, SpecError

log = logging.getLogger("training.run")

_TRAIN_KEYS = {"steps", "global_batch", "lr", "seed", "dp_impl", "weight_decay", "grad_clip", "compile",
               "precision"}


def _section(job: dict[str, Any], name: str) -> dict[str, Any]:
    value = job.get(name) or {}
    if not isinstance(value, dict):
        raise SpecError(f"{name} must be a mapping, got {value!r}")
    return value


def _build(cls: type, job: dict[str, Any], name: str) -> Any:
    section = _section(job, name)
    allowed = set(cls.__dataclass_fields__)
    unknown = set(section) - allowed
    if unknown:
        raise SpecError(f"unknown {name} field(s): {', '.join(sorted(unknown))}; "
                        f"allowed: {', '.join(sorted(allowed))}")
    return cls(**section)


def _flag(section: dict[str, Any], key: str) -> bool:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise SpecError(f"train.{key} must be true or false, got {value!r}")
    return value


def run_config_from_job(job: dict[str, Any], world_size: int, device_type: str = "cpu") -> RunConfig:
    """A RunConfig from a Lattice job yaml (explicit model and layout only); train.precision defaults
    to bf16_fp32_adam on CUDA and fp32 elsewhere."""
    model = _section(job, "model")
    if "preset" in model:
        raise SpecError(
            f"model.preset ({model['preset']!r}) needs the Lattice service's model catalogue; "
            "training.run takes explicit model fields: layers, hidden, heads, vocab, seq_len "
            "(optional: kv_heads, ffn, tied_embeddings, activation)"
        )
    spec = ModelSpec.from_dict(model)
    train = _section(job, "train")
    unknown = set(train) - _TRAIN_KEYS
    if unknown:
        raise SpecError(f"unknown train field(s): {', '.join(sorted(unknown))}; "
                        f"allowed: {', '.join(sorted(_TRAIN_KEYS))}")
    if "steps" not in train:
        raise SpecError("train.steps is required")

    par = job.get("parallelism")
    if par is None:
        par = {"dp": world_size}
    if not isinstance(par, dict):
        raise LayoutError(
            f"parallelism: {par!r} needs the Lattice planner; training.run takes an explicit layout dict "
            "(tp, pp, dp, zero_stage, micro_batch_size, num_microbatches, schedule, ...)"
        )
    par = dict(par)
    global_batch = train.get("global_batch")
    if global_batch is not None and "micro_batch_size" not in par:
        # Derive the micro-batch size from the global batch: gb = dp x mbs x num_microbatches.
        per = par.get("dp", 1) * par.get("num_microbatches", 1)
        if global_batch % per:
            raise LayoutError(
                f"train.global_batch ({global_batch}) must be divisible by parallelism.dp x "
                f"num_microbatches ({per})"
            )
        par["micro_batch_size"] = global_batch // per
    layout = Layout.from_dict(par)
    if global_batch is not None and layout.global_batch != global_batch:
        raise LayoutError(
            f"train.global_batch ({global_batch}) must equal dp x micro_batch_size x num_microbatches "
            f"({layout.global_batch})"
        )
    layout.check_world_size(world_size)

    optim = OptimConfig()
    for key in ("lr", "weight_decay", "grad_clip"):
        if key in train:
            optim = replace(optim, **{key: train[key]})
    return RunConfig(
        model=spec,
        layout=layout,
        steps=int(train["steps"]),
        seed=int(train.get("seed", 0)),
        optim=optim,
        data=_build(DataConfig, job, "data"),
        checkpoint=_build(CheckpointConfig, job, "checkpoint"),
        dp_impl=train.get("dp_impl", "lattice"),
        compile=_flag(train, "compile"),
        precision=train.get("precision") or ("bf16_fp32_adam" if device_type == "cuda" else "fp32"),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="Lattice job yaml")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--checkpoint-dir", help="override checkpoint.dir")
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    args = parser.parse_args(argv)

    from training.data.sources import DataError
    from training.parallel.dist import init_from_env, shutdown
    from training.train import StepInfo, TrainHooks, train

    ctx = init_from_env()
    logging.basicConfig(level=logging.INFO if ctx.rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank{ctx.rank} %(name)s: %(message)s")
    try:
        job = yaml.safe_load(args.spec.read_text()) or {}
        if args.steps is not None:
            job.setdefault("train", {})["steps"] = args.steps
        if args.checkpoint_dir is not None:
            job.setdefault("checkpoint", {})["dir"] = args.checkpoint_dir
        cfg = run_config_from_job(job, ctx.world_size, ctx.device.type)

        class Progress(TrainHooks):
            def on_step(self, info: StepInfo) -> None:
                if ctx.rank == 0:
                    mfu = f" mfu {info.mfu:.1%}" if info.mfu is not None else ""
                    log.info("step %d loss %.4f %.0f tok/s %.3fs%s",
                             info.step, info.loss, info.tokens_per_s, info.step_time_s, mfu)

        log.info("layout %s on %d ranks", cfg.layout.describe(), ctx.world_size)
        result = train(ctx, cfg, Progress(), resume=not args.no_resume)
        if ctx.rank == 0:
            print(f"final_step={result.final_step} model_digest={result.model_digest}", flush=True)
        return 0
    except (SpecError, LayoutError, DataError) as e:
        if ctx.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
