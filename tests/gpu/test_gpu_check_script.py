"""bench/gpu_check.py on a machine without a GPU: the clear refusal, the report's formatting on fake
numbers, the planner's predictions it compares with, and one layout measured on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import GLOBAL_BATCH, LAYOUTS, NO_CUDA, LayoutResult
from tests.distributed import run_ranks
from training.config.spec import ModelSpec

GIB = 2.0**30


def test_without_cuda_it_exits_nonzero_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.md"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == NO_CUDA and len(err.strip().splitlines()) == 1
    assert not out.exists()


def _fake_rows() -> list[LayoutResult]:
    good = LayoutResult("none", 4, 2, predicted_s=1.0, calibrated_s=0.8, predicted_mfu=0.5,
                        plan_memory=40 * GIB, measured_s=0.9, measured_mfu=0.45, peak_memory=42 * GIB)
    slow = LayoutResult("full", 2, 4, predicted_s=1.2, calibrated_s=None, predicted_mfu=0.4,
                        plan_memory=20 * GIB, measured_s=1.8, measured_mfu=0.3, peak_memory=30 * GIB)
    oom = LayoutResult("selective", 4, 2, predicted_s=1.1, plan_memory=50 * GIB, error="out of memory")
    return [good, slow, oom]


def test_layout_table_shows_predicted_measured_and_their_ratios() -> None:
    table = gpu_check.layout_table(_fake_rows())
    assert len(table) == 2 + 3
    good, slow, oom = (row.split(" | ") for row in table[2:])
    assert good[0] == "| recompute=none mbs=4 x2"
    assert good[1:10] == ["1.000", "0.800", "0.900", "1.12", "50.0%", "45.0%", "40.0", "42.0", "1.05"]
    assert slow[2] == "-" and slow[4] == "1.50"  # no calibrated prediction: measured / catalogue
    assert slow[9] == "1.50"  # 30 / 20 GiB
    assert oom[3] == "-" and oom[-1] == "out of memory |"


def test_verdicts_judge_each_target() -> None:
    best, memory, step = gpu_check.verdicts(_fake_rows())
    assert "recompute=none mbs=4 x2" in best and "45.0%" in best and "meets" in best
    assert "worst 1.50" in memory and "not all within 10%" in memory
    assert "worst 1.50" in step and "not all within 25%" in step
    only_good = gpu_check.verdicts(_fake_rows()[:1])
    assert "all within 10%" in only_good[1] and "not" not in only_good[1]
    assert "all within 25%" in only_good[2] and "not" not in only_good[2]
    assert gpu_check.verdicts([LayoutResult("none", 2, 4)]) == ["- no layout ran: no verdict"]
    assert "misses" in gpu_check.verdicts([LayoutResult("none", 2, 4, measured_s=1.0, measured_mfu=0.2)])[0]


def test_memory_table_puts_each_term_beside_the_plan() -> None:
    row = LayoutResult("none", 2, 4, plan_terms={"params": 2 * GIB, "grads": 2 * GIB, "optimizer": 12 * GIB,
                                                 "activations": 10 * GIB, "total": 26 * GIB},
                       measured_terms={"params": 2 * GIB, "grads": 2 * GIB, "optimizer": 12.6 * GIB,
                                       "activations": 8 * GIB, "peak_allocated": 30 * GIB})
    table = gpu_check.memory_table([row, LayoutResult("full", 2, 4)])  # no account: no rows
    assert len(table) == 2 + 4
    assert table[4] == "| recompute=none mbs=2 x4 | optimizer | 12.00 | 12.60 | 1.05 |"
    assert table[5].endswith("| activations | 10.00 | 8.00 | 0.80 |")
    none = gpu_check.memory_table([LayoutResult("full", 2, 4)])
    assert none == ["(no memory account: the engine reported none)"]


def test_report_has_every_section() -> None:
    cal = {"matmul": {"bf16": [[4096, 4096, 4096, 700e12]], "fp32": [[4096, 4096, 4096, 50e12]]},
           "attention": [[2048, 128, 400e12]], "memory_bw": 4.1e12}
    text = gpu_check.format_report({"device": "NVIDIA H200"}, cal, _fake_rows(), "3 passed in 9.1s\n")
    assert text.startswith("# gpu_check: NVIDIA H200")
    assert "| 4096 x 4096 x 4096 | 700.0 | 50.0 |" in text
    assert "best 400.0 TFLOP/s (seq 2048, head_dim 128)" in text and "4100 GB/s" in text
    assert "## Against the targets" in text and "3 passed in 9.1s" in text
    assert "calibration: not available" in gpu_check.format_report({}, None, [], "")
    assert "(not run)" in gpu_check.format_report({}, None, [], "")


def test_report_path(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("OUT", raising=False)
    assert str(gpu_check.report_path(None)) == "gpu_check.md"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.report_path(None) == tmp_path / "gpu_check.md"
    assert str(gpu_check.report_path("x/r.md")) == "x/r.md"


def test_planner_gpu_names() -> None:
    assert gpu_check.planner_gpu("NVIDIA H200") == "H200-141GB"
    assert gpu_check.planner_gpu("NVIDIA H100 80GB HBM3") == "H100-80GB"


def test_a_gpu_is_calibrated_at_the_shapes_a_training_step_runs() -> None:
    from training.calibration import Grid

    cpu, gpu = Grid.for_device(torch.device("cpu")), Grid.for_device(torch.device("cuda", 0))
    assert cpu == Grid()  # CPU nodes keep the default grid
    # The 1B model's matmuls (hidden 2048, ffn 8192) and its sequence (2048) lie inside the GPU grid,
    # not beyond the CPU grid's largest point, where the curve would be extrapolated.
    assert max(gpu.matmul_sizes) >= 8192 > max(cpu.matmul_sizes)
    assert max(gpu.attention_seqs) >= 2 * gpu_check.SEQ and 128 in gpu.head_dims
    assert gpu.attention_heads >= 32 and gpu.flops_per_timing > cpu.flops_per_timing
    assert gpu.copy_bytes >= 1 << 30 and gpu.collectives


def test_every_layout_gets_the_planners_prediction_and_fits_one_h200() -> None:
    from training.calibration import Grid, calibrate

    doc = calibrate("cpu-test", Grid(matmul_sizes=(32, 64), attention_seqs=(64,), head_dims=(32,),
                                     copy_bytes=1 << 20, repeats=1, collectives=False))
    rows = [LayoutResult(rec, mbs, GLOBAL_BATCH // mbs) for rec, mbs in LAYOUTS]
    assert gpu_check.predict(rows, "H200-141GB", doc) == []
    model = gpu_check.model_1b()
    from service.planner import total_params

    assert 1.0e9 < total_params(model) < 1.5e9  # ~1B parameters
    for r in rows:
        assert set(gpu_check.MEMORY_TERMS) <= set(r.plan_terms)
        assert r.error is None and r.predicted_s > 0 and r.calibrated_s > 0 and 0 < r.predicted_mfu < 1
        assert 16 * 1.0e9 < r.plan_memory < 141 * GIB, r.label  # 16 bytes/param and activations fit
    by = {(r.recompute, r.micro_batch): r for r in rows}
    assert by[("full", 4)].plan_memory < by[("none", 4)].plan_memory  # recompute trades memory...
    assert by[("full", 4)].predicted_s > by[("none", 4)].predicted_s  # ...for time


def _measure_small(rank: int, world: int) -> dict:
    from training.parallel.dist import DistContext

    r = LayoutResult("selective", 2, 2, flops_per_step=1e9)
    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=64)
    gpu_check.measure(r, DistContext(0, 1, torch.device("cpu"), "gloo"), peak_flops=1e12, steps=2,
                      compile_on=False, model=spec)
    return {"error": r.error, "measured_s": r.measured_s, "mfu": r.measured_mfu, "losses": r.losses,
            "peak": r.peak_memory, "terms": r.measured_terms}


def test_measure_trains_one_layout_in_bf16() -> None:
    [out] = run_ranks(1, _measure_small)
    assert out["error"] is None
    assert len(out["losses"]) == 4 and all(math.isfinite(x) for x in out["losses"])
    assert out["measured_s"] > 0 and out["mfu"] == pytest.approx(1e9 / (out["measured_s"] * 1e12))
    assert out["peak"] is None  # no allocator peak on CPU
    terms = out["terms"]  # the engine's own account (Trainer.memory)
    assert terms["params"] > 0 and terms["optimizer"] > terms["params"]


def test_main_wires_calibration_layouts_and_tests_into_one_report(tmp_path, monkeypatch) -> None:
    """main() with the GPU parts stood in for: every layout measured, the report written to $OUT."""
    import training.parallel.dist as lattice_dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(lattice_dist, "init_distributed", lambda *a, **k: "ctx")
    monkeypatch.setattr(lattice_dist, "shutdown", lambda: None)
    monkeypatch.setattr(gpu_check, "calibrate_gpu", lambda: None)
    measured: list[tuple[str, object, float]] = []

    def fake_measure(r: LayoutResult, ctx: object, peak: float, steps: int, compile_on: bool) -> None:
        measured.append((r.label, ctx, peak))
        r.measured_s, r.peak_memory = r.predicted_s * 1.1, r.plan_memory * 0.95
        r.measured_mfu = r.flops_per_step / (r.measured_s * peak)

    monkeypatch.setattr(gpu_check, "measure", fake_measure)
    monkeypatch.setattr(gpu_check, "run_gpu_tests", lambda timeout_s, target: f"5 passed in 42.0s ({target})")
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main([]) == 0
    assert len(measured) == len(LAYOUTS) and {m[1] for m in measured} == {"ctx"}
    assert {m[2] for m in measured} == {989e12}  # the H200's dense bf16 peak from the catalogue
    text = (tmp_path / "gpu_check.md").read_text()
    assert "# gpu_check: NVIDIA H200" in text and "planner gpu type: H200-141GB" in text
    assert text.count("| recompute=") == len(LAYOUTS) and "| 1.10 |" in text and "| 0.95 |" in text
    assert "all within 10%" in text and "all within 25%" in text and "5 passed in 42.0s (tests/gpu)" in text


def test_profile_summary_counts_kernels_by_their_gpu_self_time() -> None:
    from types import SimpleNamespace

    from bench.gpu_profile import profile_lines, summarize

    def avg(key: str, count: int, self_us: float, total_us: float, cpu_us: float) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, self_device_time_total=self_us,
                               device_time_total=total_us, cpu_time_total=cpu_us)

    events = [avg("sm90_gemm_bf16", 10, 3000.0, 3000.0, 0.0),
              avg("elementwise_kernel", 50, 1000.0, 1000.0, 0.0), avg("aten::mm", 10, 0.0, 3000.0, 400.0),
              avg("aten::add", 50, 0.0, 1000.0, 900.0),
              avg("Optimizer.step#AdamW.step", 1, 500.0, 500.0, 50.0),
              avg("aten::mm", 10, 3000.0, 3000.0, 400.0),  # torch 2.11: an op with its kernels' self time
              avg("void at::native::vectorized_elementwise_kernel<8>", 4, 10.0, 10.0, 0.0),
              avg("cudaLaunchKernel", 60, 0.0, 0.0, 800.0)]  # fmt: skip
    p = summarize(events, "x", wall_s=0.008)
    assert p.gpu_busy_s == pytest.approx(0.00401) and p.kernels == 64  # kernels only, operators not again
    assert [k[0] for k in p.top_kernels][:2] == ["sm90_gemm_bf16", "elementwise_kernel"]
    assert [o[0] for o in p.top_ops] == ["aten::mm", "aten::mm", "aten::add"]
    text = "\n".join(profile_lines([p]))
    assert "| x | 0.008 | 0.004 | 0.50 | 64 |" in text and "sm90_gemm_bf16" in text


def _profile_small(rank: int, world: int) -> dict:
    from bench.gpu_profile import profile_layout
    from training.parallel.dist import DistContext

    spec = ModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, seq_len=16, ffn=64)
    p = profile_layout(LayoutResult("none", 2, 2), DistContext(0, 1, torch.device("cpu"), "gloo"), model=spec)
    return {"error": p.error, "wall": p.wall_s, "ops": len(p.top_ops), "busy": p.gpu_busy_s}


def test_a_step_is_profiled_through_the_engine() -> None:
    [out] = run_ranks(1, _profile_small)
    assert out["error"] is None and out["wall"] > 0
    assert out["busy"] == 0.0 and out["ops"] == 0  # on CPU no kernel has GPU time
