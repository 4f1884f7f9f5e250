"""The one owner of a job's parallel degrees and knobs.

`Layout` is shared by the planner (pure Python, no torch), the scheduler and placement,
and the training engine. Rank arithmetic lives here and nowhere else: rank order puts TP
fastest-varying, then CP, then DP (and EP folded into DP), then PP, so a TP group is a run
of consecutive ranks and lands inside one node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

Schedule = Literal[
    "none", "gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
]
Recompute = Literal["none", "selective", "full"]

SCHEDULES: tuple[str, ...] = (
    "none",
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)
# Schedules that put more than one stage (a "virtual" stage) on each pipeline rank.
MULTI_STAGE_SCHEDULES: tuple[str, ...] = (
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
)
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")  # slowest -> fastest varying


class LayoutError(ValueError):
    """A layout that cannot run; the message names the field and what is allowed."""


@dataclass(frozen=True)
class RankCoord:
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    # Expert parallel degree. Experts are sharded over `ep` ranks carved out of dp x cp
    # (the DeepSeek/torchtitan convention), so it does not change the world size.
    ep: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "none"
    sequence_parallel: bool = False
    recompute: str = "none"
    # Pipeline stages per pipeline rank; 1 for flat schedules, >= 2 for interleaved / V schedules.
    virtual_stages: int = 1
    # ZeRO-2/3 only: the dp ranks form `dp_replicate` groups of dp / dp_replicate; FSDP shards the
    # state within a group and all-reduces gradients across groups (HSDP, torchtitan's
    # dp_replicate x dp_shard), so every shard has dp_replicate copies and a lost rank a DP peer.
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        self.validate()

    # ---- validation -------------------------------------------------------------------
    def validate(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch_size", "num_microbatches", "virtual_stages",
                     "dp_replicate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"layout.{name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"layout.zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"layout.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(
                f"layout.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if self.pp == 1 and self.schedule != "none":
            raise LayoutError(f"layout.schedule must be 'none' when pp == 1, got {self.schedule!r}")
        if self.pp > 1 and self.schedule == "none":
            raise LayoutError("layout.schedule must name a pipeline schedule when pp > 1 (e.g. '1f1b')")
        if self.schedule in MULTI_STAGE_SCHEDULES and self.virtual_stages < 2:
            raise LayoutError(f"layout.virtual_stages must be >= 2 for schedule {self.schedule!r}")
        if self.schedule in ("zbv_zero_bubble", "dualpipev") and self.virtual_stages != 2:
            raise LayoutError(f"layout.virtual_stages must be 2 for the V-shaped schedule {self.schedule!r}")
        if self.schedule not in MULTI_STAGE_SCHEDULES and self.virtual_stages != 1:
            raise LayoutError(f"layout.virtual_stages must be 1 for schedule {self.schedule!r}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("layout.sequence_parallel needs tp > 1")
        if (self.dp * self.cp) % self.ep != 0:
            raise LayoutError(f"layout.ep ({self.ep}) must divide dp x cp ({self.dp * self.cp})")
        if self.dp_replicate > 1:
            if self.dp % self.dp_replicate != 0:
                raise LayoutError(f"layout.dp_replicate ({self.dp_replicate}) must divide dp ({self.dp})")
            if self.zero_stage < 2:
                raise LayoutError("layout.dp_replicate > 1 needs zero_stage 2 or 3 (it replicates FSDP's "
                                  f"shards; ZeRO-{self.zero_stage} replicates the parameters already)")
            if self.cp > 1 or self.ep > 1:
                raise LayoutError("layout.dp_replicate > 1 needs cp = 1 and ep = 1")
        if self.pp > 1 and self.num_microbatches < self.pp and self.schedule != "gpipe":
            raise LayoutError(
                f"layout.num_microbatches ({self.num_microbatches}) must be >= pp ({self.pp}) "
                f"for schedule {self.schedule!r}"
            )

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise LayoutError(f"tp x cp x dp x pp = {self.world_size} must equal the world size {world_size}")

    # ---- derived quantities -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def dp_shard(self) -> int:
        """Ranks one ZeRO/FSDP shard group spans: dp, or dp / dp_replicate under HSDP."""
        return self.dp // self.dp_replicate

    def shard_peers(self, rank: int) -> list[int]:
        """The other ranks that hold exactly this rank's model state (parameters, optimizer): its
        DP replicas under ZeRO-0, HSDP's other replicate groups under ZeRO-2/3 (same shard index);
        none under ZeRO-1/2/3 otherwise (the state is sharded over every DP rank)."""
        c = self.coord(rank)
        if self.zero_stage == 0 or self.dp_replicate > 1:
            step = self.dp_shard if self.zero_stage >= 2 else 1
            return [self.rank_of(c.pp, d, c.cp, c.tp) for d in range(c.dp % step, self.dp, step) if d != c.dp]
        return []

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of {self.world_size}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return RankCoord(rank=rank, pp=pp, dp=dp, cp=cp, tp=tp)

    def rank_of(self, pp: int, dp: int, cp: int, tp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self) -> list[RankCoord]:
        return [self.coord(r) for r in range(self.world_size)]

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise LayoutError(
                f"unknown layout field(s): {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def with_(self, **changes: Any) -> Layout:
        return replace(self, **changes)

    def with_dp(self, dp: int, num_microbatches: int, shard: int | None = None) -> Layout:
        """This layout on `dp` replicas (a replan, growing back). HSDP keeps its shard groups of
        `shard` ranks (default: this layout's dp_shard; growing back passes the planned layout's),
        so each rank's share of the state is unchanged, and changes how many there are, when `dp`
        allows it; otherwise it becomes plain ZeRO-2/3 over `dp`. LayoutError if no layout runs."""
        r = 1
        shard = shard or (self.dp_shard if self.dp_replicate > 1 else None)
        if shard and self.zero_stage >= 2 and dp % shard == 0:
            r = dp // shard
        return replace(self, dp=dp, num_microbatches=num_microbatches, dp_replicate=r)

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        parts += [f"zero={self.zero_stage}", f"mbs={self.micro_batch_size}", f"m={self.num_microbatches}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.virtual_stages > 1:
            parts.append(f"v={self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate={self.dp_replicate}")
        return ",".join(parts)
