"""The network tiers a parallel group crosses and the alpha-beta time of ring collectives on them."""

from __future__ import annotations

from dataclasses import dataclass

from service.planner.formulas import hops, ring_bytes


def plus(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return a[0] + b[0], a[1] + b[1]  # (bytes, seconds) of two collectives


@dataclass(frozen=True, slots=True)
class Tier:
    name: str  # "intra-node" (NVLink), "inter-node" (InfiniBand), "inter-rack" (IB / oversubscription)
    bw: float
    latency: float


def collective(kind: str, nbytes: float, n: int, tier: Tier, count: int) -> tuple[float, float]:
    """(bytes sent per rank, seconds) for `count` ring collectives moving `nbytes` in total (alpha-beta)."""
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    sent = ring_bytes(kind, nbytes, n)
    steps = hops(n) * (2 if kind == "all_reduce" else 1)
    return sent, sent / tier.bw + steps * tier.latency * count


def off_node(moves: tuple[tuple[str, float], ...], n: int, tier: Tier, node: Tier, count: int) -> float:
    """Seconds the collectives `moves` ((kind, bytes), ...) among `n` ranks take on `tier` beyond the
    intra-node tier: what an engine cost measured inside one node adds when its group spans nodes."""
    if tier is node:
        return 0.0
    extra = sum(collective(k, b, n, tier, count)[1] - collective(k, b, n, node, count)[1] for k, b in moves)
    return max(0.0, extra)


def wider(moves: tuple[tuple[str, float], ...], n: int, measured: int, tier: Tier, count: int) -> float:
    """Seconds the collectives `moves` among `n` ranks take on `tier` beyond the same among the
    `measured` ranks an engine cost was timed on (calibration: 2): more latency steps (formulas.hops)
    and a larger share of the bytes sent (formulas.ring_bytes) than at n = 2."""
    if n <= measured:
        return 0.0
    return max(0.0, sum(collective(k, b, n, tier, count)[1] - collective(k, b, measured, tier, count)[1]
                        for k, b in moves))
