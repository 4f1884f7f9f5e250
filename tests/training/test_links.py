"""A rank that leaves a failed attempt frees the peers blocked on it in a collective (gloo).

Gloo notices a departed peer only when its TCP connection closes, which on CPU only the process's
exit does (destroy_process_group, abort and shutdown leave it open: docs/fault_tolerance.md); so a
rank that stays alive holding kept state would leave its peers waiting for the collective timeout.
Here rank 1 never joins rank 0's all-reduce, severs its gloo connections and stays alive until rank
0 has left the collective: rank 0 must fail with a closed connection while rank 1 is still alive."""

from __future__ import annotations

import time
from pathlib import Path

from tests.distributed import run_ranks


def _worker(rank: int, world: int, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from training.parallel.dist import gloo_links

    group = dist.new_group([0, 1])
    links = gloo_links()
    assert links is not None
    links.record()
    dist.barrier()
    left = Path(root) / "rank0-left"
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4), group=group)
            outcome = "completed"
        except RuntimeError as e:
            outcome = str(e)
        left.write_text(outcome)
        return {"outcome": outcome, "ports": sorted(links.ports), "mine": sorted(links.mine)}
    severed = links.sever()  # rank 1 leaves without joining, as a survivor that failed elsewhere
    deadline = time.monotonic() + 150  # the group's timeout is 180 s (tests.distributed)
    while not left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"severed": severed, "freed_while_alive": left.exists(), "mine": sorted(links.mine)}


def test_a_severed_rank_frees_its_blocked_peer(tmp_path):
    first, second = run_ranks(2, _worker, (str(tmp_path),), timeout_s=240)
    assert second["freed_while_alive"], first
    assert "Connection closed by peer" in first["outcome"], first["outcome"]
    assert second["severed"] >= 1
    # every rank's gloo listening ports are known to all: rank 1's own among them
    assert set(second["mine"]) and set(second["mine"]) <= set(first["ports"])
