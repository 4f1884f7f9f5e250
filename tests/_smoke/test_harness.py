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


def _env_and_exit(rank: int, world: int) -> tuple[str | None, str | None]:
    import os

    return os.environ.get("LATTICE_HARNESS_PROBE"), os.environ.get("LATTICE_HARNESS_GONE")


def test_ranks_see_the_callers_environment_at_the_call(monkeypatch):
    # The forkserver was started earlier in the session, with another environment: each rank gets
    # the caller's, as a spawned one would (set, changed and removed variables alike).
    monkeypatch.setenv("LATTICE_HARNESS_GONE", "stale")
    run_ranks(2, _env_and_exit)  # the forkserver exists from here on, with the variable set
    monkeypatch.setenv("LATTICE_HARNESS_PROBE", "first")
    monkeypatch.delenv("LATTICE_HARNESS_GONE")
    assert run_ranks(2, _env_and_exit) == [("first", None)] * 2
    monkeypatch.setenv("LATTICE_HARNESS_PROBE", "second")
    assert run_ranks(2, _env_and_exit, start_method="spawn") == [("second", None)] * 2
