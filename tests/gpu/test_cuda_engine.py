"""The engine on CUDA (marked `gpu`: skipped without a CUDA device; tests/conftest.py).

Each test runs one rank in a fresh spawned process with the hardware's backend (NCCL), as a rank actor
does: the device is cuda:0 of the visible set, the group is bound to it, AdamW is fused, attention is
SDPA's flash kernel in bf16, and `train.compile` works. Tolerances are bf16's: 8 significant bits.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from training.config.layout import Layout
from training.config.run import OptimConfig, RunConfig
from training.config.spec import ModelSpec

pytestmark = pytest.mark.gpu

SPEC = ModelSpec(layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seq_len=64, ffn=256)
STEPS = 3


def _entry(fn: Callable[..., Any], port: int, args: tuple, queue: Any, cpu: bool) -> None:
    from training.parallel.dist import DistContext, init_distributed, shutdown

    try:
        if cpu:  # the reference: a gloo rank on the CPU
            init_distributed(0, 1, "127.0.0.1", port, backend="gloo", timeout_s=120)
            ctx = DistContext(0, 1, torch.device("cpu"), "gloo")
        else:
            ctx = init_distributed(0, 1, "127.0.0.1", port, timeout_s=120)  # NCCL when CUDA is present
        queue.put((True, fn(ctx, *args)))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((False, traceback.format_exc()))
    finally:
        shutdown()


def one_rank(fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0, cpu: bool = False) -> Any:
    """fn(ctx, *args) on one rank in a spawned process (CUDA cannot be forked); its plain result."""
    from training.parallel.dist import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_entry, args=(fn, free_port(), args, queue, cpu))
    proc.start()
    try:
        ok, payload = queue.get(timeout=timeout_s)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert ok, payload
    return payload


def _config(precision: str, compile_on: bool = False, recompute: str = "none") -> RunConfig:
    return RunConfig(model=SPEC, layout=Layout(micro_batch_size=2, num_microbatches=2, recompute=recompute),
                     steps=STEPS, seed=1, optim=OptimConfig(lr=1e-3, eps=1e-6), precision=precision,
                     compile=compile_on)


def _train(ctx: Any, cfg: RunConfig) -> dict:
    from training.train import Trainer

    trainer = Trainer(ctx, cfg)
    losses = [trainer.train_step(step)[0] for step in range(1, STEPS + 1)]
    opt = trainer.optimizers[0]
    inner = getattr(opt, "inner", opt)
    state = {k: v.float().cpu() for k, v in trainer.full_state().items()}
    out = {"losses": losses, "state": {k: v.flatten().tolist() for k, v in state.items()},
           "device": str(ctx.device), "backend": ctx.backend, "fused": inner.defaults.get("fused"),
           "current": torch.cuda.current_device() if torch.cuda.is_available() else None}
    trainer.close()
    return out


def _rel(a: list[float], b: list[float]) -> float:
    ta, tb = torch.tensor(a), torch.tensor(b)
    return float((ta - tb).norm() / tb.norm().clamp_min(1e-12))


def test_one_rank_step_on_cuda_matches_cpu_within_bf16_tolerance() -> None:
    cuda = one_rank(_train, _config("bf16_fp32_adam"))
    cpu = one_rank(_train, _config("fp32"), cpu=True)
    assert cpu["device"] == "cpu"
    assert cuda["device"] == "cuda:0" and cuda["backend"] == "nccl" and cuda["current"] == 0
    assert cuda["fused"] is True and not cpu["fused"]  # fused AdamW only for CUDA parameters
    assert all(math.isfinite(x) for x in cuda["losses"])
    assert cuda["losses"] == pytest.approx(cpu["losses"], rel=2e-2)
    for name, ref in cpu["state"].items():
        assert _rel(cuda["state"][name], ref) < 2e-2, name  # fp32 masters after 3 bf16 steps


def _compile_on_off(ctx: Any) -> dict:
    on = _train(ctx, _config("bf16_fp32_adam", compile_on=True, recompute="selective"))
    off = _train(ctx, _config("bf16_fp32_adam", recompute="selective"))
    return {"on": on, "off": off}


def test_compile_on_and_off_give_the_same_loss_on_cuda() -> None:
    out = one_rank(_compile_on_off, timeout_s=600)
    assert out["on"]["losses"] == pytest.approx(out["off"]["losses"], rel=2e-2)
    assert sorted(out["on"]["state"]) == sorted(out["off"]["state"])  # same names, no _orig_mod.
    for name, ref in out["off"]["state"].items():
        assert _rel(out["on"]["state"][name], ref) < 2e-2, name


def _flash_attention(ctx: Any) -> list[int]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from training.model.transformer import build_model

    model = build_model(SPEC, seed=0, device=ctx.device).to(torch.bfloat16)
    x = torch.randint(0, SPEC.vocab, (2, SPEC.seq_len), device=ctx.device)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if the model's attention cannot use flash
        logits = model(x)
        logits.float().sum().backward()
    return list(logits.shape)


def test_attention_runs_on_the_flash_kernel_in_bf16() -> None:
    assert one_rank(_flash_attention) == [2, SPEC.seq_len, SPEC.vocab]


def _memory(ctx: Any) -> dict:
    from service.planner import ClusterSpec, TrainSpec, evaluate
    from training.train import Trainer

    # ~160M parameters: the allocator's fixed costs (cuBLAS workspace, ...) are small beside them.
    spec = ModelSpec(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=32000, seq_len=1024, ffn=2816)
    layout = Layout(micro_batch_size=4, num_microbatches=1)
    cfg = RunConfig(model=spec, layout=layout, steps=2, precision="bf16_fp32_adam")
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(ctx, cfg)
    for step in (1, 2):
        trainer.train_step(step)
    peak = torch.cuda.max_memory_allocated()
    account = getattr(trainer, "memory", None)  # the engine's first-step account (training.parallel.memory)
    terms = account.to_dict() if account is not None else None
    trainer.close()
    plan = evaluate(spec, TrainSpec(global_batch=4, seq_len=1024, precision="bf16_fp32_adam"),
                    ClusterSpec("H100-80GB", 1), layout)
    return {"peak": peak, "plan": plan.memory_per_gpu_bytes, "terms": terms}


def test_peak_memory_on_cuda_is_near_the_plan() -> None:
    out = one_rank(_memory)
    states = sum(out["plan"][k] for k in ("params", "grads", "optimizer") if k in out["plan"])
    assert out["peak"] >= 0.9 * states  # at least the model states the plan counts
    # The allocator's peak is the plan without its reserve (CUDA context, NCCL buffers, fragmentation:
    # memory max_memory_allocated does not see); it includes the loss backward's fp32 transient.
    allocated = out["plan"]["total"] - out["plan"]["reserve"]
    assert out["plan"]["loss_backward"] > 0
    assert out["peak"] == pytest.approx(allocated, rel=0.10)
    terms = out["terms"]
    assert terms is not None, "the engine reports its memory account on the first step"
    for key in ("params", "grads", "optimizer"):  # exact byte counts: the plan's 2 + 2 + 12 per parameter
        assert terms[key] == pytest.approx(out["plan"][key], rel=0.10), key
    assert terms["activations"] == pytest.approx(out["plan"]["activations"], rel=0.25)
    assert terms["peak_allocated"] is not None and terms["peak_allocated"] > 0


def _flight_recorder(ctx: Any, folder: str) -> dict:
    import torch.distributed as dist

    from training.parallel.dist import dump_flight_recorder
    from workers.collective_trace import dump_path, read_last_collectives

    t = torch.ones(8, device=ctx.device)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    path = dump_flight_recorder(dump_path(folder, 0), ctx.backend)
    return {"path": path, "last": read_last_collectives(folder, [0])}


def test_nccl_flight_recorder_names_the_last_collective(tmp_path) -> None:
    out = one_rank(_flight_recorder, str(tmp_path))
    assert out["path"] is not None
    assert out["last"][0]["op"] == "nccl:all_reduce"
