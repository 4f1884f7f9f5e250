"""Mixed precision (train.precision, training.parallel.precision) on 2 gloo ranks: a bf16_fp32_adam
run trains, its loss tracks the fp32 run's within bf16 tolerance, masters and AdamW state are fp32,
our DDP / ZeRO-1 reduce bf16 gradients, and fp32 runs keep the plain fp32 optimizer path."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from training.config.layout import Layout
from training.config.run import OptimConfig, RunConfig
from training.config.spec import ModelSpec, SpecError

STEPS = 3
SPEC = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=128)
SPEC_PP = ModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=128)
SPEC_MOE = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, vocab=64, seq_len=16, num_experts=4, top_k=2,
                     expert_ffn=64)
LAYOUTS = {
    "ddp": (SPEC, {"dp": 2}),
    "zero1": (SPEC, {"dp": 2, "zero_stage": 1}),
    "zero3": (SPEC, {"dp": 2, "zero_stage": 3}),
    "tp_sp": (SPEC, {"tp": 2, "sequence_parallel": True}),
    "pp": (SPEC_PP, {"pp": 2, "schedule": "1f1b", "num_microbatches": 2}),
    "cp": (SPEC, {"cp": 2}),
    "ep": (SPEC_MOE, {"dp": 2, "ep": 2}),
}


def _cfg(name: str, precision: str) -> RunConfig:
    spec, layout = LAYOUTS[name]
    return RunConfig(model=spec, layout=Layout(**layout), steps=STEPS, optim=OptimConfig(lr=3e-3),
                     precision=precision)


def _run(name: str, precision: str, ctx) -> dict:
    from training.parallel.precision import MixedPrecisionOptimizer
    from training.train import Trainer

    trainer = Trainer(ctx, _cfg(name, precision))
    losses = [trainer.train_step(step)[0] for step in range(1, STEPS + 1)]
    params = [p for part in trainer.parts for p in part.parameters()]
    out: dict = {"losses": losses, "param_dtypes": sorted({str(p.dtype) for p in params}),
                 "digest": trainer.digest()}
    opt = trainer.optimizers[0]
    out["wrapped"] = isinstance(opt, MixedPrecisionOptimizer)
    inner = opt
    while getattr(inner, "inner", None) is not None:  # mixed precision -> ZeRO-1 -> AdamW
        inner = inner.inner
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    out["state_dtypes"] = sorted({str(t.dtype) for t in state})
    if out["wrapped"]:
        out["master_dtypes"] = sorted({str(m.dtype) for m in opt.masters.masters})
        out["masters_owned"] = len(opt.masters.masters)
        out["params_total"] = len(opt.masters.params)
    buckets = getattr(trainer.modules[0], "_buckets", None)
    if buckets is not None:
        out["bucket_dtypes"] = sorted({str(b.buffer.dtype) for b in buckets})
    return out


def _worker(rank: int, world: int) -> dict:
    from training.parallel.dist import DistContext

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    return {f"{name}/{prec}": _run(name, prec, ctx)
            for name in LAYOUTS for prec in ("fp32", "bf16_fp32_adam")}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(2, _worker, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_trains_close_to_fp32(results, name: str) -> None:
    fp32, bf16 = results[0][f"{name}/fp32"], results[0][f"{name}/bf16_fp32_adam"]
    assert bf16["losses"][-1] < bf16["losses"][0]  # it trains
    for a, b in zip(fp32["losses"], bf16["losses"], strict=True):
        assert abs(a - b) <= 0.02 * abs(a), (fp32["losses"], bf16["losses"])  # bf16: 8 mantissa bits
    assert fp32["losses"] != bf16["losses"]  # the bf16 run really computed in bf16
    assert bf16["state_dtypes"] == ["torch.float32"]  # AdamW moments in fp32


@pytest.mark.parametrize("name", ["ddp", "zero1", "tp_sp", "pp", "cp", "ep"])
def test_bf16_params_with_fp32_masters(results, name: str) -> None:
    bf16 = results[0][f"{name}/bf16_fp32_adam"]
    assert bf16["wrapped"] and bf16["param_dtypes"] == ["torch.bfloat16"]
    assert bf16["master_dtypes"] == ["torch.float32"]
    if name == "zero1":  # each rank keeps masters only for the parameters it owns
        owned = [r[f"{name}/bf16_fp32_adam"]["masters_owned"] for r in results]
        assert sum(owned) == bf16["params_total"] and max(owned) < bf16["params_total"]


def test_fsdp_shards_are_fp32_masters(results) -> None:
    bf16 = results[0]["zero3/bf16_fp32_adam"]
    assert not bf16["wrapped"] and bf16["param_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_ddp_reduces_in_bf16(results, name: str) -> None:
    assert results[0][f"{name}/bf16_fp32_adam"]["bucket_dtypes"] == ["torch.bfloat16"]
    assert results[0][f"{name}/fp32"]["bucket_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_keeps_the_plain_path(results, name: str) -> None:
    fp32 = results[0][f"{name}/fp32"]
    assert not fp32["wrapped"] and fp32["param_dtypes"] == ["torch.float32"]


def test_replicas_agree_on_master_digest(results) -> None:
    for key in results[0]:
        if not key.startswith(("tp_sp", "pp")):  # digests are of the full (gathered) model
            assert results[0][key]["digest"] == results[1][key]["digest"], key


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(SpecError, match="train.precision"):
        _cfg("ddp", "fp16")


def test_default_precision_is_fp32_on_the_cpu_cluster_and_bf16_on_gpus() -> None:
    from service.planner import default_precision

    assert default_precision("cpu-virtual") == "fp32"
    assert default_precision("H100-80GB") == "bf16_fp32_adam"


def test_torchrun_spec_takes_precision_with_a_device_default() -> None:
    from training.run import run_config_from_job

    job = {"model": {"layers": 2, "hidden": 64, "heads": 4, "vocab": 64, "seq_len": 16},
           "train": {"steps": 1, "global_batch": 2}}
    assert run_config_from_job(job, 1, "cpu").precision == "fp32"
    assert run_config_from_job(job, 1, "cuda").precision == "bf16_fp32_adam"
    job["train"]["precision"] = "bf16_fp32_adam"
    assert run_config_from_job(job, 1, "cpu").precision == "bf16_fp32_adam"


def _resume_worker(rank: int, world: int, root: str) -> dict:
    from dataclasses import replace

    from training.config.run import CheckpointConfig
    from training.parallel.dist import DistContext
    from training.train import train

    ctx = DistContext(rank, world, torch.device("cpu"), "gloo")
    out = {}
    for name in ("ddp", "zero1"):
        cfg = _cfg(name, "bf16_fp32_adam")
        straight = train(ctx, replace(cfg, steps=2), resume=False).model_digest
        ckpt = replace(cfg, checkpoint=CheckpointConfig(dir=f"{root}/{name}", every_steps=1))
        train(ctx, replace(ckpt, steps=1), resume=False)
        resumed = train(ctx, replace(ckpt, steps=2), resume=True)
        out[name] = (straight, resumed.model_digest, resumed.resumed_from)
    return out


def test_bf16_resume_from_checkpoint_equals_uninterrupted(tmp_path) -> None:
    """Checkpoints keep the fp32 masters (ZeRO-1: gathered from their owners), so a resumed bf16 run
    continues bit for bit."""
    for name, (straight, resumed, start) in run_ranks(2, _resume_worker, (str(tmp_path),))[0].items():
        assert start == 1 and resumed == straight, name
