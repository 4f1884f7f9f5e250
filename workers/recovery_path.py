"""Which way a lost rank comes back: from a DP peer's memory (no rollback) or from the checkpoint.

Pure logic (no Ray): the worker group asks after the survivors have ended the failed step and said
which step's state they kept (`RankActor.kept`). The peer path applies when the run's replicas hold
everything a rank holds (`RunConfig.peer_recovery_blocker`), every survivor kept the state of the
same step, and every lost rank has a surviving peer at the same (pp, tp, cp) coordinate, i.e. the
same model shard in another DP replica. Under ZeRO-1 with shadow shards (training.parallel.zero) a
lost rank's optimizer shard survives only on the rank that shadows it, its predecessor in the DP
ring (dp - 1 mod DP), which must survive and be its source; its own shadow (of dp + 1's shard) is
copied from that owner, which survives too as no two ring neighbours were both lost. Under ZeRO-2/3
with HSDP (layout.dp_replicate > 1) a peer must also hold the same FSDP shard: the same position in
another replicate group (dp mod dp_shard). Otherwise the reason says why the checkpoint is used.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.config.run import RunConfig
from workers.placement import RankPlacement


@dataclass(frozen=True)
class RecoveryPath:
    path: str  # "peer" or "checkpoint"
    why: str
    step: int | None = None  # the peers' step (peer path)
    sources: dict[int, int] = field(default_factory=dict)  # lost rank -> the survivor that sends it state
    lost: tuple[int, ...] = ()  # every rank replaced (the lost ones and TP partners that moved with them)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "why": self.why, "lost": list(self.lost)}
        if self.path == "peer":
            out.update(step=self.step, sources={str(k): v for k, v in sorted(self.sources.items())})
        return out


def choose(run_cfg: RunConfig, ranks: Sequence[RankPlacement], lost: Collection[int],
           kept: Mapping[int, int | None], *, enabled: bool = True) -> RecoveryPath:
    """`ranks`: every rank's coordinates; `lost`: the ranks being replaced; `kept`: each survivor's
    kept step (None: it kept nothing, e.g. it failed inside an optimizer update)."""
    if not enabled:
        return RecoveryPath("checkpoint", "peer recovery is off")
    blocker = run_cfg.peer_recovery_blocker()
    if blocker is not None:
        return RecoveryPath("checkpoint", blocker)
    survivors = [r for r in ranks if r.rank not in lost]
    if not survivors:
        return RecoveryPath("checkpoint", "every rank was lost")
    empty = sorted(r.rank for r in survivors if kept.get(r.rank) is None)
    if empty:
        return RecoveryPath("checkpoint", f"ranks {empty} kept no whole step in memory")
    steps = {kept[r.rank] for r in survivors}
    if len(steps) != 1:
        stopped = sorted(s for s in steps if s is not None)
        return RecoveryPath("checkpoint", f"survivors stopped at different steps {stopped}")
    step = next(iter(steps))
    sources: dict[int, int] = {}
    load: dict[int, int] = {}
    layout = run_cfg.layout
    for r in sorted((x for x in ranks if x.rank in lost), key=lambda x: x.rank):
        if layout.zero_stage == 1:  # the shadow of r's optimizer shard is on dp - 1 only
            before = (r.dp - 1) % layout.dp
            peers = [s for s in survivors if (s.pp, s.tp, s.cp, s.dp) == (r.pp, r.tp, r.cp, before)]
            if not peers:
                return RecoveryPath("checkpoint", f"rank {r.rank}'s ZeRO-1 shard was lost with its shadow "
                                    f"(DP ring neighbour dp {before} lost too)")
        else:  # ZeRO-0: every DP replica; HSDP: the same FSDP shard in each other replicate group
            holders = set(layout.shard_peers(r.rank))
            peers = [s for s in survivors if s.rank in holders]
        if not peers:
            return RecoveryPath("checkpoint", f"rank {r.rank} has no healthy DP peer (its shard is lost)")
        src = min(peers, key=lambda s: (load.get(s.rank, 0), s.rank))  # spread the sends
        sources[r.rank] = src.rank
        load[src.rank] = load.get(src.rank, 0) + 1
    assert step is not None
    return RecoveryPath("peer", f"every lost rank has a healthy DP peer at step {step}", step, sources)
