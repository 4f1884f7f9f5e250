import torch
import torch.distributed as dist

from tests.distributed import RankFailed, run_ranks


def _allreduce(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one exploded")
    dist.barrier()


def test_run_ranks_all_reduce():
    assert run_ranks(3, _allreduce) == [6.0, 6.0, 6.0]


def test_run_ranks_reports_failure():
    try:
        run_ranks(2, _boom, timeout_s=60)
    except RankFailed as e:
        assert "rank one exploded" in str(e)
    else:
        raise AssertionError("expected RankFailed")
