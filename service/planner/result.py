"""The planner's answer: a Layout plus the evidence for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.planner.costmodel import Combo, Env, Micro, Stage, dp_exposed, finish
from service.planner.formulas import total_params
from training.config.layout import Layout

GiB = 1024**3

# Time components of a step, in the order they are reported.
TIME_PARTS = ("compute", "recompute", "tp", "cp", "ep", "pp_p2p", "bubble", "dp_exposed", "optimizer",
              "overhead")
_PART_WORDS = {
    "compute": "more compute per GPU",
    "recompute": "recomputation",
    "tp": "more tensor-parallel traffic",
    "cp": "exposed context-parallel ring traffic",
    "ep": "expert all-to-all traffic",
    "pp_p2p": "pipeline point-to-point traffic",
    "bubble": "a larger pipeline bubble",
    "dp_exposed": "exposed data-parallel traffic",
    "optimizer": "a larger optimizer step",
    "overhead": "the training loop's own work per step",
}


def describe(layout: Layout) -> str:
    """Layout.describe() plus the interleaving depth, so the text parses back to the same layout."""
    return layout.describe()


def fmt_bytes(nbytes: float) -> str:
    """Human-readable bytes (binary units)."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass
class Detail:
    """Every number of one candidate, derived from the same objects the search used."""

    layout: Layout
    step_time_s: float
    memory: dict[str, float]
    time_s: dict[str, float]
    comm: dict[str, float]
    bubble: float
    fits: bool
    tiers: dict[str, str]


def build_detail(stage: Stage, micro: Micro, combo: Combo, z: int, layout: Layout) -> Detail:
    fam, env = stage.fam, stage.fam.env
    step, mem_total = finish(stage, combo, z)
    m, layers = combo.m, stage.layers
    first = sum(stage.state_first[z]) + combo.act_first + combo.loss_first
    last = sum(stage.state_last[z]) + combo.act_last + combo.loss_last
    state, act, loss = (
        (stage.state_first[z], combo.act_first, combo.loss_first) if first >= last
        else (stage.state_last[z], combo.act_last, combo.loss_last)
    )  # fmt: skip
    memory = {
        "params": state[0],
        "grads": state[1],
        "optimizer": state[2],
        "activations": act,
        "loss_backward": loss,  # transient: the loss's fp32 gradients over the vocabulary
        "buffers": stage.buffers[z],
        "reserve": env.reserve,
        "total": mem_total,
        "capacity": env.capacity,
    }
    recompute_t = micro.t_compute - micro.t_compute_plain
    time_s = {
        "compute": m * (layers * micro.t_compute_plain + micro.t_head),
        "recompute": m * layers * recompute_t,
        "tp": m * (layers * micro.t_tp + micro.t_tp_edge),
        "cp": m * layers * micro.t_cp,
        "ep": m * layers * micro.t_ep,
        "pp_p2p": m * stage.v * micro.t_p2p,
        "bubble": combo.core - m * combo.t_mb,
        "dp_exposed": dp_exposed(stage, combo, z),
        "optimizer": stage.opt[z],
        "overhead": env.step_overhead,  # data, checks, loss summary (costmodel.finish)
    }
    comm = {
        "tp": m * layers * micro.tp_bytes,
        "pp": m * stage.v * micro.p2p_bytes,
        "dp": stage.dp_bytes_once[z] + m * stage.dp_bytes_per_mb[z],  # HSDP's all-reduce: dp_replicate
        "cp": m * layers * micro.cp_bytes,
        "ep": m * layers * micro.ep_bytes,
    }
    tiers = {
        "tp": fam.tp_tier.name,
        "cp": fam.cp_tier.name,
        "dp": fam.dp_tier.name,
        "pp": fam.pp_tier.name,
        "ep": fam.ep_tier.name,
    }
    if fam.r > 1:  # HSDP: FSDP's collectives stay in a shard group; the gradient all-reduce spans dp
        comm["dp_replicate"] = stage.hsdp_bytes[z]
        tiers["dp"], tiers["dp_replicate"] = fam.shard_tier.name, fam.dp_tier.name
    return Detail(layout, step, memory, time_s, comm, combo.bubble, mem_total <= env.capacity, tiers)


def why_slower(slow: Detail, fast: Detail) -> str:
    """The time component that grew most from `fast` to `slow`, in words."""
    worst = max(TIME_PARTS, key=lambda k: slow.time_s[k] - fast.time_s[k])
    delta = slow.time_s[worst] - fast.time_s[worst]
    return f"{_PART_WORDS[worst]} (+{delta * 1e3:.3g} ms)"


@dataclass
class Plan:
    """A Layout plus the evidence for it (see docs/planner.md for every field)."""

    layout: Layout
    mode: str  # "search" (nothing given), "fill" (a partial layout completed) or "evaluate" (as given)
    model_name: str
    gpu_type: str
    num_gpus: int
    global_batch: int
    seq_len: int
    precision: str
    params_total: int
    flops_per_step: float
    step_time_s: float
    mfu: float
    tokens_per_s: float
    tflops_per_gpu: float
    bubble_fraction: float
    memory_per_gpu_bytes: dict[str, float]
    comm_bytes_per_step: dict[str, float]
    time_breakdown_s: dict[str, float]
    link_tiers: dict[str, str]
    fits: bool
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    candidates_evaluated: int = 0
    # The layout fields the request gave (a partial or explicit layout), kept as given; None = "auto".
    given: dict[str, Any] | None = None
    # The hardware profile the time model used ({node_type, version}); None = the catalogue's curves.
    profile: dict[str, Any] | None = None

    @classmethod
    def from_detail(cls, d: Detail, *, mode: str, env: Env) -> Plan:
        n = env.n
        step = d.step_time_s
        return cls(
            layout=d.layout,
            mode=mode,
            model_name=env.model.name,
            gpu_type=env.gpu.name,
            num_gpus=n,
            global_batch=env.g,
            seq_len=env.s,
            precision=env.train.precision,
            params_total=total_params(env.model),
            flops_per_step=env.flops_per_step,
            step_time_s=step,
            mfu=env.flops_per_step / (step * env.eff.peak * n),
            tokens_per_s=env.g * env.s / step,
            tflops_per_gpu=env.flops_per_step / (step * n) / 1e12,
            bubble_fraction=d.bubble,
            memory_per_gpu_bytes=dict(d.memory),
            comm_bytes_per_step=dict(d.comm),
            time_breakdown_s=dict(d.time_s),
            link_tiers=dict(d.tiers),
            fits=d.fits,
            profile=env.profile.ref if env.profile is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "mode": self.mode,
            "model": self.model_name,
            "cluster": {"gpu_type": self.gpu_type, "num_gpus": self.num_gpus},
            "train": {
                "global_batch": self.global_batch,
                "seq_len": self.seq_len,
                "precision": self.precision,
            },
            "params_total": self.params_total,
            "layout": {
                "tp": lay.tp,
                "pp": lay.pp,
                "dp": lay.dp,
                "cp": lay.cp,
                "ep": lay.ep,
                "zero_stage": lay.zero_stage,
                "micro_batch_size": lay.micro_batch_size,
                "num_microbatches": lay.num_microbatches,
                "schedule": lay.schedule,
                "virtual_stages": lay.virtual_stages,
                "sequence_parallel": lay.sequence_parallel,
                "recompute": lay.recompute,
                # HSDP only (so plans without it keep their fields): Layout.from_dict reads it back
                **({"dp_replicate": lay.dp_replicate} if lay.dp_replicate > 1 else {}),
            },
            "memory_per_gpu_bytes": {k: int(round(v)) for k, v in self.memory_per_gpu_bytes.items()},
            "fits": self.fits,
            "predicted": {
                "step_time_s": self.step_time_s,
                "mfu": self.mfu,
                "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu,
            },
            "flops_per_step": self.flops_per_step,
            "bubble_fraction": self.bubble_fraction,
            "comm_bytes_per_step": {k: int(round(v)) for k, v in self.comm_bytes_per_step.items()},
            "time_breakdown_s": dict(self.time_breakdown_s),
            "link_tiers": dict(self.link_tiers),
            "alternatives": [dict(a) for a in self.alternatives],
            "reasons": list(self.reasons),
            "rejected": [dict(r) for r in self.rejected],
            "candidates_evaluated": self.candidates_evaluated,
            "given": dict(self.given) if self.given is not None else None,
            "profile": dict(self.profile) if self.profile is not None else None,
        }
