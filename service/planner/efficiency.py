"""Achieved compute and link speed as functions of shape: the planner's efficiency curves (pure Python).

A matmul's time comes from its (m, n, k), attention's from its sequence length and head size, a
collective's from its message size. The curves come either from a measured `HardwareProfile`
(`lattice calibrate`, training/calibration) or from the catalogued curve of a built-in GPU type.
docs/planner.md ("Efficiency curves") gives the model and its sources.

    profile = HardwareProfile.from_dict(doc)        # a stored profile (service.store.profiles)
    eff = Efficiency.for_gpu(gpu, profile)          # or Efficiency.for_gpu(gpu) for the catalogue
    eff.matmul_time(4096, 4096, 4096)               # seconds
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from training.config.hardware import GpuType

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")


@dataclass(frozen=True)
class CatalogCurve:
    """Parametric curves of a built-in GPU type (no measurement).

    matmul: rate(F) = peak * mm_max * F / (F + mm_half_flops), capped by the roofline I * hbm_bw;
    attention: rate(s) = peak * attn_max * s / (s + attn_half_seq).
    """

    mm_max: float
    mm_half_flops: float
    attn_max: float
    attn_half_seq: float


# Large dense bf16 GEMMs reach ~75-85% of peak on A100 (NVIDIA "Matrix Multiplication Background"
# performance guide, A100 GEMM sweeps) and sustain ~650-700 of 989 TFLOP/s on H100/H200 at 700 W; e_max
# is set inside those ranges once for all rows of bench/planner_accuracy.py (docs/planner.md). A
# half-rate size of ~1.5e9 FLOPs is a ~10 us fixed cost per kernel (launch + tail wave). Flash
# attention fwd+bwd: ~55% of peak on A100 at head dim 128 (Dao 2023, FlashAttention-2, Fig. 5), ~45% on
# H100 without FA3 (same paper, H100 figure), half rate near 512 tokens.
_DATACENTER = {
    "A100": CatalogCurve(0.74, 1.5e9, 0.55, 512.0),
    "H100": CatalogCurve(0.68, 3.0e9, 0.45, 512.0),
    "H200": CatalogCurve(0.68, 3.0e9, 0.45, 512.0),
    "B200": CatalogCurve(0.70, 6.0e9, 0.45, 512.0),
}

# Memory-bound (elementwise) traffic per token per layer, forward + backward, in units of
# hidden * activation bytes: LayerNorm x2, dropout x2, residual x2 and bias adds each read and write
# the (b, s, h) activation forward and about twice that backward (~5 passes per op, ~8 ops), replicated
# over TP ranks unless sequence parallel (Korthikanti et al. 2022, Sec. 4.2.2 counts the same ops);
# the MLP activation function touches (b, s, ffn/tp) about as often.
ELEMENTWISE_PASSES_HIDDEN = 40.0
ELEMENTWISE_PASSES_FFN = 5.0
# Ops one transformer block runs per micro-batch, forward + backward: ~65 forward ops and ~80 autograd
# nodes per block of training/model/transformer.py (counted with torch.profiler and the autograd graph).
LAYER_OPS = 150


@dataclass(frozen=True)
class HardwareProfile:
    """What `lattice calibrate` measured on one node type; `version` increases per node type."""

    node_type: str
    version: int
    compute_dtype: str  # the dtype the trainer computes in on this node type ("fp32" on CPU, "bf16" on GPU)
    matmul: Mapping[str, Sequence[tuple[int, int, int, float]]]  # dtype -> [(m, n, k, FLOP/s)]
    attention: Sequence[tuple[int, int, float]] = ()  # [(seq_len, head_dim, FLOP/s fwd+bwd)]
    memory_bw: float = 0.0  # bytes/s, large device-to-device copy (read + write)
    op_overhead_s: float = 0.0  # fixed cost per op forward + backward (dispatch, autograd, launch)
    # The engine's optimizer step (clip + AdamW) as measured: fixed seconds per parameter tensor and
    # seconds per parameter (0: not measured; the fp32 state's bytes at the memory bandwidth instead).
    optimizer_tensor_s: float = 0.0
    optimizer_param_s: float = 0.0
    collectives: Mapping[str, Sequence[tuple[float, float]]] = field(
        default_factory=dict
    )  # kind -> [(bytes, s)]
    ranks: int = 2  # ranks of the collective measurement (intra-node)
    backend: str = ""
    # The same collectives between two nodes of this type, one rank on each (the inter-node tier);
    # empty when the type had one node when calibrated: the catalogue's inter-node link then.
    inter_node: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)
    # The engine's own parallel code as it issues collectives (training/calibration/engine.py; CPU/gloo):
    # seconds per tensor-parallel linear (forward + backward, with its one all-reduce) by activation bytes,
    # per ZeRO-3 FSDP2 unit (all-gather x2 + reduce-scatter with copies and hooks) by parameter bytes,
    # per step of the bucketed DDP (hooks, all-reduces, final wait) by gradient bytes,
    # and the slowdown of compute when every rank of the host computes at once.
    tp_linear: Sequence[tuple[float, float]] = ()
    fsdp_unit: Sequence[tuple[float, float]] = ()
    ddp_step: Sequence[tuple[float, float]] = ()
    concurrency: float = 1.0
    # Slowdown over the ideal share when several rank processes share each core, by workload ("ops":
    # tiny autograd ops, "matmul"): [(processes per core, factor)] (training/calibration/oversubscription.py).
    oversubscription: Mapping[str, Sequence[tuple[float, float]]] = field(default_factory=dict)
    # Seconds FSDP2's DTensor parameters add per tensor to the optimizer step (ZeRO-2/3). 0: not measured.
    fsdp_optimizer_tensor_s: float = 0.0
    # Seconds per step of the engine's training loop outside forward + backward, the DP reduction and the
    # optimizer step (data, integrity checks, loss summary; training/calibration/engine.py). 0: not measured.
    step_overhead_s: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)  # device name, threads, seconds taken

    @property
    def ref(self) -> dict[str, Any]:
        """What a plan records about the profile it used."""
        return {"node_type": self.node_type, "version": self.version}

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_type": self.node_type,
            "version": self.version,
            "compute_dtype": self.compute_dtype,
            "matmul": {d: [list(p) for p in pts] for d, pts in self.matmul.items()},
            "attention": [list(p) for p in self.attention],
            "memory_bw": self.memory_bw,
            "op_overhead_s": self.op_overhead_s,
            "optimizer_tensor_s": self.optimizer_tensor_s,
            "optimizer_param_s": self.optimizer_param_s,
            "collectives": {k: [list(p) for p in pts] for k, pts in self.collectives.items()},
            "ranks": self.ranks,
            "backend": self.backend,
            "inter_node": {k: [list(p) for p in pts] for k, pts in self.inter_node.items()},
            "tp_linear": [list(p) for p in self.tp_linear],
            "fsdp_unit": [list(p) for p in self.fsdp_unit],
            "ddp_step": [list(p) for p in self.ddp_step],
            "concurrency": self.concurrency,
            "oversubscription": {k: [list(p) for p in pts] for k, pts in self.oversubscription.items()},
            "fsdp_optimizer_tensor_s": self.fsdp_optimizer_tensor_s,
            "step_overhead_s": self.step_overhead_s,
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HardwareProfile:
        """A profile from its stored JSON; ValueError naming the field when malformed."""
        try:
            matmul = {str(d): [(int(a), int(b), int(c), float(r)) for a, b, c, r in pts]
                      for d, pts in doc["matmul"].items()}  # fmt: skip
            attention = [(int(s), int(hd), float(r)) for s, hd, r in doc.get("attention", [])]
            coll, inter = ({str(k): [(float(b), float(t)) for b, t in pts]
                            for k, pts in (doc.get(key) or {}).items()}
                           for key in ("collectives", "inter_node"))  # fmt: skip
            engine = {k: [(float(b), float(t)) for b, t in doc.get(k) or []]
                      for k in ("tp_linear", "fsdp_unit", "ddp_step")}  # fmt: skip
            dtype = str(doc.get("compute_dtype") or next(iter(matmul), "fp32"))
            if dtype not in matmul:
                raise ValueError(f"compute_dtype {dtype!r} has no matmul measurements")
            return cls(
                node_type=str(doc["node_type"]), version=int(doc.get("version", 0)), compute_dtype=dtype,
                matmul=matmul, attention=attention, memory_bw=float(doc.get("memory_bw", 0.0)),
                op_overhead_s=float(doc.get("op_overhead_s", 0.0)),
                optimizer_tensor_s=float(doc.get("optimizer_tensor_s", 0.0)),
                optimizer_param_s=float(doc.get("optimizer_param_s", 0.0)),
                collectives=coll, ranks=int(doc.get("ranks", 2)), backend=str(doc.get("backend", "")),
                inter_node=inter,
                tp_linear=engine["tp_linear"], fsdp_unit=engine["fsdp_unit"], ddp_step=engine["ddp_step"],
                concurrency=max(1.0, float(doc.get("concurrency", 1.0))),
                oversubscription={str(k): [(float(a), max(1.0, float(f))) for a, f in pts]
                                  for k, pts in (doc.get("oversubscription") or {}).items()},
                fsdp_optimizer_tensor_s=max(0.0, float(doc.get("fsdp_optimizer_tensor_s", 0.0))),
                step_overhead_s=max(0.0, float(doc.get("step_overhead_s", 0.0))),
                meta=dict(doc.get("meta", {})),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"profile: malformed hardware profile ({e})") from e


class MonotoneCurve:
    """Piecewise-linear y(log x) through measured points made non-decreasing by isotonic regression
    (pool adjacent violators, Barlow et al. 1972: a bigger problem never runs slower per FLOP than a
    smaller one; noise between neighbours is averaged, not kept at its maximum); flat beyond both ends."""

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        pts = sorted((float(x), float(y)) for x, y in points if x > 0 and y > 0)
        if not pts:
            raise ValueError("a curve needs at least one positive point")
        self.xs = [math.log(x) for x, _ in pts]
        blocks: list[list[float]] = []  # [sum, count]
        for _, y in pts:
            blocks.append([y, 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        self.ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]

    def __call__(self, x: float) -> float:
        lx = math.log(max(x, 1e-300))
        i = bisect.bisect_right(self.xs, lx)
        if i == 0:
            return self.ys[0]
        if i == len(self.xs):
            return self.ys[-1]
        x0, x1, y0, y1 = self.xs[i - 1], self.xs[i], self.ys[i - 1], self.ys[i]
        return y0 + (y1 - y0) * (lx - x0) / (x1 - x0) if x1 > x0 else y1


def fit_alpha_beta(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of t = alpha + bytes / beta by least squares (Hockney 1994)."""
    pts = [(b, t) for b, t in points if b > 0 and t > 0]
    if not pts:
        raise ValueError("no collective measurements")
    if len(pts) == 1:
        return 0.0, pts[0][0] / pts[0][1]
    n = len(pts)
    mx, my = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    sxx = sum((b - mx) ** 2 for b, _ in pts)
    slope = sum((b - mx) * (t - my) for b, t in pts) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # noise: all messages cost the same, take the biggest's rate
        b, t = max(pts)
        return 0.0, b / t
    alpha = max(0.0, my - slope * mx)
    return alpha, 1.0 / slope


class _SizeCurve:
    """A measured cost by message size: monotone interpolation in log size between the measured points,
    flat below the smallest; beyond the largest, the extra bytes at the link's bandwidth (Hockney 1994)."""

    def __init__(self, points: Sequence[tuple[float, float]]) -> None:
        self.curve = MonotoneCurve(points)
        self.top = max(b for b, t in points if b > 0 and t > 0)

    @classmethod
    def of(cls, points: Sequence[tuple[float, float]]) -> _SizeCurve | None:
        return cls(points) if any(b > 0 and t > 0 for b, t in points) else None

    def __call__(self, nbytes: float, link_bw: float) -> float:
        extra = max(0.0, nbytes - self.top) / link_bw if link_bw > 0 else 0.0
        return self.curve(nbytes) + extra


def _ring_link(collectives: Mapping[str, Sequence[tuple[float, float]]], ranks: int, default_bw: float,
               default_latency: float) -> tuple[float, float]:
    """(bus bandwidth, latency per hop) of a ring from measured all-reduce times (Hockney fit over message
    sizes); the defaults when there are none."""
    if not collectives.get("all_reduce"):
        return default_bw, default_latency
    n = max(2, ranks)
    alpha, beta = fit_alpha_beta(collectives["all_reduce"])
    # A ring all-reduce sends 2(n-1)/n of the message in 2(n-1) hops (Patarasuk & Yuan 2009).
    return beta * 2 * (n - 1) / n, alpha / (2 * (n - 1))


def _slowdown(points: Sequence[tuple[float, float]], per_core: float) -> float:
    """A measured oversubscription slowdown at `per_core` processes a core: linear between (1, 1) and the
    measured levels, flat beyond the last (1 where none was measured)."""
    pts = sorted([(1.0, 1.0)] + [(a, f) for a, f in points if a > 1.0])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if per_core <= x1:
            return y0 + (y1 - y0) * (max(per_core, x0) - x0) / (x1 - x0)
    return pts[-1][1]


class Efficiency:
    """Time of matmuls, attention and elementwise work on one GPU type (measured or catalogued)."""

    def __init__(self, gpu: GpuType, profile: HardwareProfile | None = None, ranks_per_host: int = 1) -> None:
        self.gpu, self.profile = gpu, profile
        # CPU ranks run ops synchronously and share the calibrated host's cores (the embedded cluster runs
        # every rank there): `share` slows compute when ranks x threads exceed the cores.
        on_cpu = profile is not None and str(profile.meta.get("device", "")) == "cpu"
        self.synchronous = on_cpu
        threads = int(profile.meta.get("threads", 1)) if profile is not None else 1
        cores = int(profile.meta.get("cores", 0) or 0) if profile is not None else 0
        per_core = ranks_per_host * threads / cores if on_cpu and cores > 0 else 1.0
        self.share = max(1.0, per_core)
        if on_cpu and ranks_per_host >= 2 and profile is not None:  # measured: all ranks computing at once
            self.share = max(self.share, profile.concurrency)
        # More processes than cores: each also pays the others' switches and cache evictions, measured
        # per workload (training/calibration/oversubscription.py): "ops" for dispatch-bound and host
        # work, "matmul" for arithmetic. Not the engine's measured costs (tp_linear, fsdp_unit,
        # ddp_step): mostly waits for a partner, they scale with the share alone (bench.planner_embedded).
        over = profile.oversubscription if profile is not None else {}  # 1 at one process a core or fewer
        self.share_mm = self.share * _slowdown(over.get("matmul", ()), per_core)
        self.share_ops = self.share * _slowdown(over.get("ops", ()), per_core)
        self._tp_linear = _SizeCurve.of(profile.tp_linear) if profile is not None else None
        self._fsdp_unit = _SizeCurve.of(profile.fsdp_unit) if profile is not None else None
        self._ddp_step = _SizeCurve.of(profile.ddp_step) if profile is not None else None
        self.op_overhead = profile.op_overhead_s if profile is not None else 0.0
        # Host work timed with one rank per core (the optimizer step, the loop's own overhead): on CPU
        # ranks it is slowed by `share` as compute is; the loop's Python also by the ops' oversubscription
        # (the optimizer's fused passes over the state did not pay it: bench.planner_embedded, 2026-12-08).
        self.host = host = self.share if self.synchronous else 1.0
        self.ranks = profile.ranks if profile is not None else 2  # of the measured collectives, engine costs
        self.optimizer_tensor = host * profile.optimizer_tensor_s if profile is not None else 0.0
        self.optimizer_param = host * profile.optimizer_param_s if profile is not None else 0.0
        self.fsdp_optimizer_tensor = host * profile.fsdp_optimizer_tensor_s if profile is not None else 0.0
        loop = self.share_ops if self.synchronous else 1.0
        self.step_overhead = loop * profile.step_overhead_s if profile is not None else 0.0
        self.peak = gpu.peak_flops
        self.hbm_bw = profile.memory_bw if profile is not None and profile.memory_bw > 0 else gpu.hbm_bw
        family = next((k for k in _DATACENTER if gpu.name.upper().startswith(k)), None)
        # A type without a catalogued curve (the embedded CPU cluster): its one constant at every size.
        flat = CatalogCurve(gpu.compute_efficiency, 0.0, gpu.compute_efficiency, 0.0)
        self.curve = _DATACENTER[family] if family else flat
        self._mm: MonotoneCurve | None = None
        self._attn: dict[int, MonotoneCurve] = {}
        if profile is not None:
            pts = profile.matmul[profile.compute_dtype]
            self._mm = MonotoneCurve([(2.0 * m * n * k, r) for m, n, k, r in pts])
            by_hd: dict[int, list[tuple[float, float]]] = {}
            for s, hd, r in profile.attention:
                by_hd.setdefault(hd, []).append((float(s), r))
            self._attn = {hd: MonotoneCurve(p) for hd, p in by_hd.items()}
            # MFU's denominator: a measured rate above the catalogue's peak means the catalogue's figure
            # is nominal (cpu-virtual), so the best measured rate takes its place.
            self.peak = max(self.peak, max(r for *_, r in pts))
        self._cache: dict[tuple[int, int, int], float] = {}

    @classmethod
    def for_gpu(
        cls, gpu: GpuType, profile: HardwareProfile | None = None, ranks_per_host: int = 1
    ) -> Efficiency:
        return cls(gpu, profile, ranks_per_host)

    def ops_time(self, busy_s: float, ops: int = LAYER_OPS) -> float:
        """Time `ops` ops take beyond their arithmetic `busy_s`: on CPU every op's fixed cost adds (eager
        ops run synchronously); on a GPU launches are asynchronous and only the part of the host's
        dispatch time longer than the kernels shows. Catalogued GPUs: 0 (their F_half covers it)."""
        fixed = ops * self.op_overhead
        return fixed * self.share_ops if self.synchronous else max(0.0, fixed - busy_s)

    def matmul_rate(self, m: int, n: int, k: int) -> float:
        """Achieved FLOP/s of one (m, k) x (k, n) matmul."""
        flops = 2.0 * m * n * k
        if self._mm is not None:
            return self._mm(flops)
        c = self.curve
        rate = self.peak * c.mm_max * flops / (flops + c.mm_half_flops)
        # Roofline: bf16 operands and result once through HBM (Williams et al. 2009).
        intensity = flops / (2.0 * (m * k + k * n + m * n))
        return min(rate, intensity * self.hbm_bw)

    def matmul_time(self, m: int, n: int, k: int) -> float:
        key = (m, n, k)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self.share_mm * 2.0 * m * n * k / self.matmul_rate(m, n, k)
        return t

    def attention_rate(self, seq: int, head_dim: int) -> float:
        """Achieved FLOP/s of the attention core (QK^T, softmax, AV) forward + backward."""
        if self._attn:
            hd = min(self._attn, key=lambda d: (abs(d - head_dim), d))
            return self._attn[hd](seq) / self.share_mm
        if self._mm is not None:  # measured matmuls but no attention: its matmuls at that size
            return self._mm(2.0 * seq * seq * head_dim) / self.share_mm
        c = self.curve
        return self.peak * c.attn_max * seq / (seq + c.attn_half_seq)

    def elementwise_time(
        self, tokens: float, hidden_local: float, ffn_local: float, act_bytes: int = 2
    ) -> float:
        """Memory-bound work of one layer, forward + backward (see ELEMENTWISE_PASSES_*)."""
        nbytes = (
            tokens
            * act_bytes
            * (ELEMENTWISE_PASSES_HIDDEN * hidden_local + ELEMENTWISE_PASSES_FFN * ffn_local)
        )
        return nbytes / self.hbm_bw

    def tp_linear_time(self, nbytes: float, link_bw: float) -> float | None:
        """Seconds one tensor-parallel linear adds, forward + backward, beyond its matmuls (DTensor dispatch
        and its all-reduce of `nbytes`), as measured on this node type; None when not measured."""
        return self._engine(self._tp_linear, nbytes, link_bw)

    def fsdp_unit_time(self, nbytes: float, link_bw: float) -> float | None:
        """Seconds one ZeRO-3 FSDP2 unit of `nbytes` parameters adds per micro-batch (gathers, reduce-
        scatter, copies, hooks), as measured on this node type; None when not measured."""
        return self._engine(self._fsdp_unit, nbytes, link_bw)

    def ddp_step_time(self, nbytes: float, link_bw: float) -> float | None:
        """Seconds the engine's bucketed DDP adds to a step reducing `nbytes` of gradients, as measured on
        this node type; None when not measured."""
        return self._engine(self._ddp_step, nbytes, link_bw)

    def _engine(self, curve: _SizeCurve | None, nbytes: float, link_bw: float) -> float | None:
        """A measured engine cost, slowed by `share` on CPU ranks: it is host work (dispatch, gloo's
        reductions, waiting for a partner to be scheduled), timed with one rank per core."""
        if curve is None:
            return None
        return curve(nbytes, link_bw) * (self.share if self.synchronous else 1.0)

    def link(self, default_bw: float, default_latency: float) -> tuple[float, float]:
        """(bandwidth, latency per hop) of the intra-node tier: measured all-reduce (bus bandwidth of a
        ring, Hockney fit over message sizes) when profiled, else the catalogue's."""
        if self.profile is None:
            return default_bw, default_latency
        return _ring_link(self.profile.collectives, self.profile.ranks, default_bw, default_latency)

    def inter_link(self, default_bw: float, default_latency: float) -> tuple[float, float]:
        """(bandwidth, latency per hop) of the inter-node tier: the all-reduce measured between two nodes
        of this type when profiled (workers/calibration.py, measure_link), else the catalogue's."""
        if self.profile is None:
            return default_bw, default_latency
        return _ring_link(self.profile.inter_node, 2, default_bw, default_latency)

    @property
    def inter_measured(self) -> bool:
        """Whether the inter-node tier was measured, not catalogued."""
        return self.profile is not None and bool(self.profile.inter_node.get("all_reduce"))
