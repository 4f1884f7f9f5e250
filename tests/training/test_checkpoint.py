"""training.checkpoint: bit-exact round trips, atomic commit, verification, pruning, async save and
resharded loads (FSDP2 / TP / ZeRO-1 / plain AdamW across DP sizes and TP degrees), on real gloo ranks."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from tests.distributed import run_ranks
from training.checkpoint.checkpointer import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    corrupt_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    verify_checkpoint,
)

LR = 1e-2
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Net(nn.Module):
    """embedding -> fc1 -> relu -> fc2, times a persistent buffer."""

    def __init__(self, vocab: int = 16, hidden: int = 8, ffn: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(tokens)))) * self.scale  # (N, hidden)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:  # every rank sees the same batch, so no gradient sync is needed
        tokens = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(1000 + step))
        model(tokens).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(state: dict) -> dict:
    """Unsharded copies: DTensors gathered, tensors cloned, other values as they are."""
    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


def _model_full(model: nn.Module) -> dict:
    return _full(get_model_state_dict(model))


def _optim_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return _full(get_optimizer_state_dict(model, opt, options=FLAT))


def _zero1_owned(model: nn.Module, zopt) -> dict:
    """This rank's ZeRO-1 state in the flattened FQN format: {"state.<fqn>.<name>": tensor}."""
    names = {p: n for n, p in model.named_parameters()}
    return {f"state.{names[p]}.{k}": v.detach().clone()
            for p in zopt.owned_params() for k, v in zopt.inner.state[p].items()}


def _assert_same(actual: dict, expected: dict, prefix: str = "") -> None:
    keys = sorted(k for k in expected if k.startswith(prefix))
    assert keys, f"nothing to compare under {prefix!r}"
    for k in keys:
        a, e = actual[k], expected[k]
        if isinstance(e, torch.Tensor):
            assert torch.equal(a, e), f"{k} differs"
        else:
            assert a == e, f"{k}: {a!r} != {e!r}"


def _draws() -> tuple:
    return torch.rand(3), random.random(), float(np.random.rand())


def _same_draws(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def _fsdp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp(model: nn.Module, world: int) -> nn.Module:
    """FSDP2 over a (replicate 2, shard world / 2) mesh, as layout.dp_replicate = 2 builds it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    for m in (model.fc1, model.fc2, model):
        fully_shard(m, mesh=mesh)
    return model


def _tp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _zero1(model: nn.Module, lr: float = LR):
    from training.parallel.zero import ShardedOptimizer

    return ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr)


# ------------------------------------------------------------------------------------------------
# two ranks: save in every layout (checking same-layout round trips there), keep references
# ------------------------------------------------------------------------------------------------
def _two_rank_saves(rank: int, world: int, root: str) -> None:
    ckpt = Checkpointer()
    out: dict = {}

    # replicated model + AdamW: bit-exact round trip, each rank's own RNG streams restored
    model, opt = _net(0), None
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(2))
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    info = ckpt.save(f"{root}/plain", 2, [model], opt, {"data": {"next_step": 2}})
    assert info.committed and info.bytes > 0 and len(info.manifest_digest) == 64
    expected_draws = _draws()
    fresh = _net(1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    torch.manual_seed(7)
    assert load_latest_checkpoint(f"{root}/plain", [fresh], fresh_opt) == (2, {"data": {"next_step": 2}})
    _assert_same(_model_full(fresh), _model_full(model))
    _assert_same(_optim_full(fresh, fresh_opt), _optim_full(model, opt))
    assert _same_draws(_draws(), expected_draws), f"rank {rank}: RNG not restored"
    manifest = json.loads(open(f"{root}/plain/step-2/manifest.json").read())
    assert {f"rng/rank-{r}.pt" for r in range(world)} <= set(manifest["files"])

    # FSDP2 (ZeRO-3) on 2 ranks
    model = _fsdp(_net(0), world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(2))
    ckpt.save(f"{root}/fsdp", 2, [model], opt, {})
    out["fsdp"] = (_model_full(model), _optim_full(model, opt))
    fresh = _fsdp(_net(1), world)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_checkpoint(f"{root}/fsdp/step-2", [fresh], fresh_opt)
    _assert_same(_model_full(fresh), out["fsdp"][0])
    _assert_same(_optim_full(fresh, fresh_opt), out["fsdp"][1])
    _train(model, opt, range(2, 3))
    out["fsdp_next"] = _model_full(model)

    # tensor parallel (Megatron column/row split of the MLP) on 2 ranks
    model = _tp(_net(0), world)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(2))
    ckpt.save(f"{root}/tp", 2, [model], opt, {})
    out["tp"] = (_model_full(model), _optim_full(model, opt))

    # hand-written ZeRO-1 on 2 ranks: each rank saves the state of the parameters it owns
    model = _net(0)
    opt = _zero1(model)
    _train(model, opt, range(2))
    ckpt.save(f"{root}/zero", 2, [model], opt, {})
    out["zero"] = (_model_full(model), _zero1_owned(model, opt))
    fresh = _net(1)
    fresh_opt = _zero1(fresh, lr=0.5)
    load_checkpoint(f"{root}/zero/step-2", [fresh], fresh_opt)
    _assert_same(_zero1_owned(fresh, fresh_opt), out["zero"][1])
    assert fresh_opt.param_groups[0]["lr"] == LR == fresh_opt.inner.param_groups[0]["lr"]
    _train(model, opt, range(2, 3))
    out["zero_next"] = _model_full(model)

    # asynchronous save: staged at the call, committed by ckpt.wait_pending(), deaf to later updates
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    pending = ckpt.save(f"{root}/async", 3, [model], opt, {"k": 1}, async_save=True)
    assert not pending.committed and list_checkpoints(f"{root}/async") == []
    saved = _model_full(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    committed = ckpt.wait_pending()
    assert committed is not None and committed.committed and committed.step == 3
    assert list_checkpoints(f"{root}/async") == [3]
    verify_checkpoint(committed.path)
    load_checkpoint(committed.path, [model], opt)
    _assert_same(_model_full(model), saved)
    assert ckpt.wait_pending() is None
    torch.save(out, f"{root}/refs-rank{rank}.pt")  # tensors do not survive the rank's exit via a queue


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("ckpt2"))
    run_ranks(2, _two_rank_saves, (root,))
    return root, [torch.load(f"{root}/refs-rank{r}.pt", weights_only=True) for r in range(2)]


def test_two_rank_saves_round_trip_in_every_layout(two_rank):
    root, results = two_rank  # the same-layout round trips are asserted on the ranks
    assert all(list_checkpoints(f"{root}/{kind}") == [2] for kind in ("plain", "fsdp", "tp", "zero"))
    for kind in ("plain", "fsdp", "tp", "zero"):
        verify_checkpoint(f"{root}/{kind}/step-2")


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_sharded_checkpoint_loads_into_one_plain_process(two_rank, kind):
    root, results = two_rank
    ref_model, ref_optim = results[0][kind]
    model = _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    assert load_checkpoint(f"{root}/{kind}/step-2", [model], opt) == (2, {})
    _assert_same(_model_full(model), ref_model)
    _assert_same(_optim_full(model, opt), ref_optim, prefix="state.")
    assert opt.param_groups[0]["lr"] == LR
    if kind == "fsdp":  # and training continues as it did on 2 ranks
        _train(model, opt, range(2, 3))
        for k, v in results[0]["fsdp_next"].items():
            torch.testing.assert_close(_model_full(model)[k], v, rtol=0, atol=1e-6)


def test_zero1_checkpoint_loads_into_plain_adamw(two_rank):
    root, results = two_rank
    owned = [r["zero"][1] for r in results]
    assert owned[0] and owned[1] and not owned[0].keys() & owned[1].keys()  # a real partition
    model = _net(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(f"{root}/zero/step-2", [model], opt)
    _assert_same(_model_full(model), results[0]["zero"][0])
    _assert_same(_optim_full(model, opt), {**owned[0], **owned[1]})
    assert opt.param_groups[0]["lr"] == LR
    _train(model, opt, range(2, 3))
    _assert_same(_model_full(model), results[0]["zero_next"])


# ------------------------------------------------------------------------------------------------
# four ranks: load the 2-rank and 1-process checkpoints under other layouts
# ------------------------------------------------------------------------------------------------
def _four_rank_loads(rank: int, world: int, root: str) -> None:
    refs = torch.load(f"{root}/refs-4.pt", weights_only=True)
    model = _fsdp(_net(1), world)  # FSDP2 on 2 ranks -> FSDP2 on 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(f"{root}/fsdp/step-2", [model], opt)
    _assert_same(_model_full(model), refs["fsdp"][0])
    _assert_same(_optim_full(model, opt), refs["fsdp"][1])

    model = _hsdp(_net(1), world)  # FSDP2 on 2 ranks -> HSDP 2 x 2, which saves and reloads
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(f"{root}/fsdp/step-2", [model], opt)
    _assert_same(_model_full(model), refs["fsdp"][0])
    _assert_same(_optim_full(model, opt), refs["fsdp"][1])
    Checkpointer().save(f"{root}/hsdp", 2, [model], opt, {})

    model = _tp(_net(1), world)  # TP 2 -> TP 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(f"{root}/tp/step-2", [model], opt)
    _assert_same(_model_full(model), refs["tp"][0])
    _assert_same(_optim_full(model, opt), refs["tp"][1])

    model = _net(1)  # plain AdamW in one process -> ZeRO-1 on 4
    opt = _zero1(model, lr=0.5)
    load_checkpoint(f"{root}/single/step-2", [model], opt)
    _assert_same(_model_full(model), refs["single"][0])
    _assert_same(refs["single"][1], _zero1_owned(model, opt))  # every owned entry matches
    assert opt.param_groups[0]["lr"] == LR == opt.inner.param_groups[0]["lr"]

    model = _net(1)  # ZeRO-1 on 2 -> ZeRO-1 on 4 (another partition)
    opt = _zero1(model, lr=0.5)
    load_checkpoint(f"{root}/zero/step-2", [model], opt)
    _assert_same(refs["zero"], _zero1_owned(model, opt))


def test_checkpoints_reshard_onto_four_ranks(two_rank, tmp_path):
    ckpt = Checkpointer()
    root, results = two_rank
    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(2))
    ckpt.save(f"{root}/single", 2, [model], opt, {})
    refs = {
        "fsdp": results[0]["fsdp"], "tp": results[0]["tp"],
        "single": (_model_full(model), _optim_full(model, opt)),
        "zero": {**results[0]["zero"][1], **results[1]["zero"][1]},
    }
    torch.save(refs, f"{root}/refs-4.pt")
    run_ranks(4, _four_rank_loads, (root,))
    model = _net(1)  # HSDP 2 x 2 -> one plain process
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    load_checkpoint(f"{root}/hsdp/step-2", [model], opt)
    _assert_same(_model_full(model), refs["fsdp"][0])
    _assert_same(_optim_full(model, opt), refs["fsdp"][1])


# ------------------------------------------------------------------------------------------------
# one process: round trip, atomic commit, verification and fallback, pruning, async
# ------------------------------------------------------------------------------------------------
def _trained(seed: int = 0, steps: int = 2) -> tuple[Net, torch.optim.Optimizer]:
    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(steps))
    return model, opt


def test_round_trip_is_bit_exact_with_rng_and_data_position(tmp_path):
    from training.config.run import DataConfig
    from training.config.spec import ModelSpec
    from training.data.sources import make_data_source

    ckpt = Checkpointer()

    spec = ModelSpec(layers=1, hidden=8, heads=2, vocab=16, seq_len=6)
    data = make_data_source(DataConfig(seed=3), spec, global_batch=4)
    for step in range(2):
        data.batch(step, 0, 1)
    model, opt = _trained()
    torch.manual_seed(11)
    random.seed(11)
    np.random.seed(11)
    ckpt.save(str(tmp_path), 2, [model], opt, {"data": data.state_dict()})
    expected = _draws()
    _train(model, opt, range(2, 3))
    continued = _model_full(model)

    fresh = _net(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    torch.manual_seed(0)
    step, extra = load_latest_checkpoint(str(tmp_path), [fresh], fresh_opt)
    assert step == 2
    assert _same_draws(_draws(), expected)
    resumed = make_data_source(DataConfig(seed=3), spec, global_batch=4)
    resumed.load_state_dict(extra["data"])
    assert torch.equal(resumed.batch(2, 0, 1)[0], data.batch(2, 0, 1)[0])
    _train(fresh, fresh_opt, range(2, 3))
    _assert_same(_model_full(fresh), continued)  # resumed training is bit-identical
    _assert_same(_optim_full(fresh, fresh_opt), _optim_full(model, opt))


def test_real_transformer_with_tied_embeddings_round_trips(tmp_path):
    ckpt = Checkpointer()
    from training.config.spec import ModelSpec
    from training.model.transformer import build_model

    spec = ModelSpec(layers=1, hidden=16, heads=2, vocab=32, seq_len=8, tied_embeddings=True)
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).float().pow(2).mean().backward()
    opt.step()
    ckpt.save(str(tmp_path), 1, [model], opt, {})
    fresh = build_model(spec, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    load_checkpoint(str(tmp_path / "step-1"), [fresh], fresh_opt)
    assert fresh.output.weight is fresh.tok_embeddings.weight  # still tied
    _assert_same(_model_full(fresh), _model_full(model))
    _assert_same(_optim_full(fresh, fresh_opt), _optim_full(model, opt))


def test_tmp_dirs_are_ignored_by_list_and_load(tmp_path):
    ckpt = Checkpointer()
    model, opt = _trained()
    ckpt.save(str(tmp_path), 1, [model], opt, {"which": 1})
    shutil.copytree(tmp_path / "step-1", tmp_path / "step-5.tmp")  # a crashed save, even complete
    (tmp_path / "step-6.tmp").mkdir()
    assert list_checkpoints(str(tmp_path)) == [1]
    assert load_latest_checkpoint(str(tmp_path), [_net(1)], None) == (1, {"which": 1})
    assert list_checkpoints(str(tmp_path / "missing")) == []
    assert load_latest_checkpoint(str(tmp_path / "missing"), [_net(1)], None) is None


@pytest.mark.parametrize(
    ("which", "mode", "message"),
    [
        ("any", "flip", r"file __0_0\.distcp is damaged"),
        ("any", "truncate", r"file __0_0\.distcp has \d+ bytes, the manifest says \d+"),
        ("rng/rank-0.pt", "delete", r"file rng/rank-0\.pt is missing"),
        ("metadata", "flip", r"file \.metadata is damaged"),
        ("manifest", "delete", r"manifest\.json is missing"),
    ],
)
def test_damaged_checkpoint_is_refused_and_the_previous_one_loaded(tmp_path, which, mode, message):
    ckpt = Checkpointer()
    model, opt = _trained(steps=1)
    ckpt.save(str(tmp_path), 1, [model], opt, {"step": 1})
    at_step_1 = _model_full(model)
    _train(model, opt, range(1, 2))
    ckpt.save(str(tmp_path), 2, [model], opt, {"step": 2})
    corrupt_checkpoint(tmp_path / "step-2", which, mode)
    with pytest.raises(CheckpointCorrupt, match=message):
        verify_checkpoint(tmp_path / "step-2")
    fresh = _net(1)
    with pytest.raises(CheckpointCorrupt, match=message):
        load_checkpoint(tmp_path / "step-2", [fresh], torch.optim.AdamW(fresh.parameters(), lr=LR))
    verify_checkpoint(tmp_path / "step-1")
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    assert load_latest_checkpoint(str(tmp_path), [fresh], fresh_opt) == (1, {"step": 1})
    _assert_same(_model_full(fresh), at_step_1)
    assert load_latest_checkpoint(str(tmp_path), [fresh], fresh_opt, allowed_steps={2}) is None


def test_keep_prunes_to_the_newest_k(tmp_path):
    ckpt = Checkpointer()
    model, opt = _trained(steps=1)
    for step in range(1, 6):
        info = ckpt.save(str(tmp_path), step, [model], opt, {}, keep=2)
    assert list_checkpoints(str(tmp_path)) == [4, 5]
    assert sorted(os.listdir(tmp_path)) == ["step-4", "step-5"]  # no .tmp / .trash left behind
    assert info.path == str(tmp_path / "step-5")
    again = ckpt.save(str(tmp_path), 5, [model], opt, {"again": True}, keep=2)  # re-save a step
    assert list_checkpoints(str(tmp_path)) == [4, 5] and again.manifest_digest != info.manifest_digest
    assert load_latest_checkpoint(str(tmp_path), [_net(1)], None) == (5, {"again": True})
    with pytest.raises(ValueError, match="checkpoint.keep must be >= 1"):
        ckpt.save(str(tmp_path), 6, [model], opt, {}, keep=0)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # from DCP's writer thread
def test_async_save_commits_at_the_next_save_or_wait(tmp_path):
    ckpt = Checkpointer()
    model, opt = _trained()
    first = ckpt.save(str(tmp_path), 1, [model], opt, {}, async_save=True)
    assert not first.committed and first.path.endswith("step-1.tmp")
    assert list_checkpoints(str(tmp_path)) == []
    saved = _model_full(model)
    _train(model, opt, range(2, 3))  # training goes on while the write runs
    ckpt.save(str(tmp_path), 2, [model], opt, {}, async_save=True)  # commits step 1 first
    assert list_checkpoints(str(tmp_path)) == [1]
    info = ckpt.wait_pending()
    assert info is not None and info.step == 2 and list_checkpoints(str(tmp_path)) == [1, 2]
    fresh = _net(1)
    load_checkpoint(tmp_path / "step-1", [fresh], None)
    _assert_same(_model_full(fresh), saved)


def test_mismatched_state_and_bad_arguments_are_refused(tmp_path):
    ckpt = Checkpointer()
    model, opt = _trained()
    ckpt.save(str(tmp_path), 1, [model], None, {})  # model only
    fresh = _net(1)
    with pytest.raises(CheckpointError, match="does it hold this model and optimizer"):
        load_checkpoint(tmp_path / "step-1", [fresh], torch.optim.AdamW(fresh.parameters(), lr=LR))
    with pytest.raises(ValueError, match="JSON-serialisable"):
        ckpt.save(str(tmp_path), 2, [model], opt, {"bad": object()})
    with pytest.raises(ValueError, match="one optimizer per model part: got 2 optimizer"):
        ckpt.save(str(tmp_path), 2, [model], [opt, opt], {})
    with pytest.raises(ValueError, match=r"model parts share parameter names \['bias', 'weight'\]"):
        ckpt.save(str(tmp_path), 2, [model.fc1, model.fc2], None, {})
