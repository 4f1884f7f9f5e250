"""The CUDA path's wiring, checked on CPU with the CUDA calls stood in for (the real thing: tests/gpu)."""

from __future__ import annotations

import torch

from training.parallel import dist as lattice_dist
from training.parallel.optim import use_fused_adamw


def test_a_nccl_rank_sets_its_device_before_the_group_and_binds_the_group_to_it(monkeypatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(lattice_dist, "default_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(lattice_dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(lattice_dist.dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(lattice_dist, "enable_flight_recorder", lambda p: calls.append(("recorder", p)))
    ctx = lattice_dist.init_distributed(3, 8, "10.0.0.1", 29500, backend="nccl", timeout_s=660.0,
                                        trace_prefix="/jobs/j/flight_recorder/rank-")
    assert [c[0] for c in calls] == ["set_device", "recorder", "init"]
    init = calls[2][1]
    assert init["backend"] == "nccl" and init["device_id"] == torch.device("cuda", 0)
    assert init["timeout"].total_seconds() == 660.0 and (init["rank"], init["world_size"]) == (3, 8)
    assert calls[1][1] == "/jobs/j/flight_recorder/rank-"
    assert (ctx.device, ctx.backend) == (torch.device("cuda", 0), "nccl")


def test_a_gloo_rank_has_no_device_id_and_no_recorder_unless_given_a_folder(monkeypatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(lattice_dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(lattice_dist.dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(lattice_dist, "enable_flight_recorder", lambda p: calls.append(("recorder", p)))
    lattice_dist.init_distributed(0, 2, "127.0.0.1", 1234, backend="gloo")
    assert [c[0] for c in calls] == ["init"] and calls[0][1]["device_id"] is None


def test_fused_adamw_for_floating_point_parameters_on_cpu_and_cuda() -> None:
    assert use_fused_adamw([torch.nn.Parameter(torch.zeros(2))])
    assert not use_fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not use_fused_adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.int32), requires_grad=False)])
    assert not use_fused_adamw([])
    assert lattice_dist.default_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_the_ranks_optimizer_is_the_fused_kernel_on_cpu() -> None:
    from training.config.layout import Layout
    from training.config.run import RunConfig
    from training.config.spec import ModelSpec
    from training.parallel.optim import build_optimizer

    model = torch.nn.Linear(4, 4)
    spec = ModelSpec(layers=1, hidden=16, heads=2, vocab=64, seq_len=8)
    cfg = RunConfig(model=spec, layout=Layout(), steps=1)
    opt = build_optimizer([model], Layout(), cfg, None)
    assert opt.defaults["fused"] is True
    reference = torch.nn.Linear(4, 4)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay, fused=True)
    for m, o in ((model, opt), (reference, ref_opt)):
        torch.manual_seed(0)
        m(torch.randn(3, 4)).square().sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=True))
