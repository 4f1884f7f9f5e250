"""The ZeRO-1 shadow shard (ShardedOptimizer(shadow=True), issue 17) on real gloo ranks: each rank's
shadow of its buddy's shard equals the owner's state bit for bit, and the weights are bit-identical
to a run without shadows; a fresh optimizer that loads its shard gets its shadow from the owner."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.training.test_zero import ADAMW, groups_of, make_model, run_sharded
from training.parallel.zero import ShardedOptimizer

STEPS = 4


def _train(world: int, rank: int, shadow: bool, steps: range,
           start: tuple | None = None) -> tuple[torch.nn.Module, ShardedOptimizer]:
    torch.manual_seed(0)
    model = make_model()
    opt = ShardedOptimizer(groups_of(model), torch.optim.AdamW, shadow=shadow,
                           broadcast_bucket_mb=2 / 1024, **ADAMW)
    if start is not None:
        model.load_state_dict(start[0])
        opt.load_state_dict(start[1])
    for step in steps:
        if step == 2:  # a scheduler's change reaches the shadow as it reaches the shard
            opt.param_groups[0]["lr"] = 5e-3
        run_sharded(model, opt, rank, world, range(step, step + 1))
    return model, opt


def _by_index(opt: ShardedOptimizer, inner: torch.optim.Optimizer, params: list) -> dict:
    return {opt.param_index(p): {k: v.clone() for k, v in inner.state[p].items()} for p in params}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) for k in a[i]) for i in a)


def _shadow_worker(rank: int, world: int, tmp: str) -> dict[str, object]:
    plain, _ = _train(world, rank, False, range(STEPS))
    model, opt = _train(world, rank, True, range(STEPS))
    out: dict[str, object] = {
        "weights_equal": all(torch.equal(p, q) for p, q in
                             zip(plain.parameters(), model.parameters(), strict=True)),
        "buddy": opt.buddy,
        "shadowed": sorted(opt.param_index(p) for p in opt.shadow_params()),
        "owned_by_buddy": sorted(opt.param_index(p) for p in opt.all_params()
                                 if opt.owner_of(p) == opt.buddy),
    }
    owned = _by_index(opt, opt.inner, opt.owned_params())
    torch.save(owned, f"{tmp}/owned-{rank}.pt")
    dist.barrier()
    buddy_owned = torch.load(f"{tmp}/owned-{opt.buddy}.pt")
    out["steps_kept"] = sorted({int(s["step"]) for s in owned.values()})
    out["shadow_equal"] = _same_state(_by_index(opt, opt.shadow, opt.shadow_params()), buddy_owned)

    # A fresh optimizer that loads only its own shard (a checkpoint restore) takes its shadow from
    # the owner at its first step, then stays equal to it and to the uninterrupted run.
    start = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    model_a, opt_a = _train(world, rank, True, range(STEPS, STEPS + 2), start)
    cont_model, _ = _train(world, rank, False, range(STEPS + 2))
    out["resumed_weights_equal"] = all(torch.equal(p, q) for p, q in
                                       zip(cont_model.parameters(), model_a.parameters(), strict=True))
    torch.save(_by_index(opt_a, opt_a.inner, opt_a.owned_params()), f"{tmp}/owned2-{rank}.pt")
    dist.barrier()
    out["resumed_shadow_equal"] = _same_state(_by_index(opt_a, opt_a.shadow, opt_a.shadow_params()),
                                              torch.load(f"{tmp}/owned2-{opt.buddy}.pt"))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_shadow_equals_owner_and_weights_equal_a_run_without(world: int, tmp_path) -> None:
    results = run_ranks(world, _shadow_worker, (str(tmp_path),))
    for rank, r in enumerate(results):
        assert r["buddy"] == (rank + 1) % world
        assert r["shadowed"] == r["owned_by_buddy"] and r["shadowed"]
        assert r["steps_kept"] == [STEPS]
        assert r["shadow_equal"], rank
        assert r["weights_equal"], rank
        assert r["resumed_shadow_equal"], rank
        assert r["resumed_weights_equal"], rank


def test_one_rank_has_no_shadow() -> None:
    results = run_ranks(1, _single_worker)
    assert results == [{"shadow": None, "shadowed": 0}]


def _single_worker(rank: int, world: int) -> dict[str, object]:
    model = make_model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, shadow=True, **ADAMW)
    return {"shadow": opt.shadow, "shadowed": len(opt.shadow_params())}
