"""GPU catalogue: what one accelerator and its node can do, with sources (pure Python, no torch).

The one owner of hardware figures: the planner's cost model (service.planner.hardware re-exports
it) and the trainer's MFU metric (`peak_flops_of_device`) read the same peak FLOP/s.

Bandwidths are bytes/s per GPU in one direction (what a ring collective's bus bandwidth is measured
against). `compute_efficiency` is the fraction of dense bf16 peak that the large matmuls of a
transformer layer achieve in practice; it is the one calibration constant of the time model and is
documented in docs/planner.md ("Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GpuType:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (no sparsity)
    hbm_bytes: int
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # intra-node bytes/s per GPU per direction
    internode_bw: float  # bytes/s per GPU (one NIC per GPU) per direction
    gpus_per_node: int
    compute_efficiency: float  # achievable fraction of peak for transformer matmuls (calibrated)
    intra_latency_s: float  # per collective hop inside a node (alpha of the alpha-beta model)
    inter_latency_s: float  # per collective hop across nodes
    reserve_fixed_bytes: int  # CUDA context, kernels, NCCL buffers
    reserve_fraction: float  # allocator fragmentation, as a fraction of HBM
    description: str = ""
    # Compute time each second of communication overlapped with compute costs: NCCL's kernels take
    # 16-32 of an H100's 132 SMs and HBM bandwidth (0.15, calibrated: docs/planner.md); gloo reduces
    # on the CPU threads the ranks compute on, so on a CPU an overlapped second costs a whole second.
    overlap_slowdown: float = 0.15

    @property
    def reserve_bytes(self) -> int:
        return int(self.reserve_fixed_bytes + self.reserve_fraction * self.hbm_bytes)


# Runtime reserve for real GPUs: ~1 GiB CUDA context + kernels, ~1 GiB NCCL communicator buffers,
# and ~8% allocator fragmentation (PyTorch caching allocator, typical `reserved - allocated` gap).
_RESERVE_FIXED = 2 * GiB
_RESERVE_FRACTION = 0.08


def _datacenter(
    name: str, peak: float, hbm: int, hbm_bw: float, nvlink: float, inter: float, desc: str
) -> GpuType:
    """An 8-GPU NVSwitch node with one NIC per GPU; same calibration and latencies for every generation."""
    return GpuType(
        name=name, peak_flops=peak, hbm_bytes=hbm, hbm_bw=hbm_bw, nvlink_bw=nvlink, internode_bw=inter,
        gpus_per_node=8, compute_efficiency=0.55, intra_latency_s=5e-6, inter_latency_s=10e-6,
        reserve_fixed_bytes=_RESERVE_FIXED, reserve_fraction=_RESERVE_FRACTION, description=desc,
    )  # fmt: skip


GPU_CATALOG: dict[str, GpuType] = {
    # NVIDIA A100 datasheet (SXM4): 312 TFLOP/s bf16 dense, 40 GB HBM2 at 1,555 GB/s, NVLink3
    # 600 GB/s total (300 GB/s per direction); DGX A100: 8 GPUs, HDR 200 Gb/s (25 GB/s) per GPU.
    "A100-40GB": _datacenter("A100-40GB", 312e12, 40 * GiB, 1.555e12, 300e9, 25e9, "NVIDIA A100 SXM4 40GB"),
    # NVIDIA A100 80GB datasheet (SXM4): HBM2e at 2,039 GB/s; otherwise as above.
    "A100-80GB": _datacenter("A100-80GB", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, "NVIDIA A100 SXM4 80GB"),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink4 900 GB/s
    # total (450 GB/s per direction); DGX H100: 8 GPUs, ConnectX-7 NDR 400 Gb/s (50 GB/s) per GPU.
    "H100-80GB": _datacenter("H100-80GB", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, "NVIDIA H100 SXM5 80GB"),
    # NVIDIA H200 datasheet (SXM): H100 compute, 141 GB HBM3e at 4.8 TB/s, NVLink4 900 GB/s.
    "H200-141GB": _datacenter("H200-141GB", 989e12, 141 * GiB, 4.8e12, 450e9, 50e9, "NVIDIA H200 SXM 141GB"),
    # NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 dense for 8 GPUs -> 2.25 PFLOP/s bf16 dense per GPU,
    # 1,440 GB HBM3e (180 GB per GPU) at 8 TB/s, NVLink5 1.8 TB/s total (900 GB/s per direction),
    # ConnectX-7 400 Gb/s (50 GB/s) per GPU.
    "B200": _datacenter("B200", 2.25e15, 180 * GiB, 8.0e12, 900e9, 50e9, "NVIDIA B200 (DGX B200)"),
    # The embedded CPU cluster: each "GPU" is one gloo process on a shared CPU, each "node" a group of
    # them. Nothing here is a hardware limit; the numbers make the virtual cluster behave like a real
    # one at toy scale (docs/planner.md, "cpu-virtual"):
    #  - 20 GFLOP/s: one CPU core's fp32 FMA throughput, order of magnitude;
    #  - inside a node 2 GB/s and 50 us per hop: gloo between processes on one host;
    #  - across nodes 20 MB/s and 200 us: the lecture's node cliff, scaled so that bandwidth-hungry
    #    traffic (TP, DP) must stay inside a virtual node and only PP crosses it;
    #  - 3456 KiB of memory: a budget under which the demo model (preset "demo", 14 MB of model state at
    #    16 bytes/param) needs tensor parallel to fit without recomputation (3200 KiB before the plan
    #    counted the loss backward's transient, 256 KiB for the demo at micro-batch 1).
    # With these the planner picks tp=2, pp=2, dp=2 for the demo on 8 GPUs (4 per node) by itself.
    "cpu-virtual": GpuType(
        name="cpu-virtual",
        peak_flops=2e10,
        hbm_bytes=3456 * 1024,
        hbm_bw=20e9,
        nvlink_bw=2e9,
        internode_bw=2e7,
        gpus_per_node=4,
        compute_efficiency=0.5,
        intra_latency_s=50e-6,
        inter_latency_s=200e-6,
        reserve_fixed_bytes=0,
        reserve_fraction=0.0,
        description="embedded CPU cluster (gloo processes; memory is a planning budget, see docs/planner.md)",
        overlap_slowdown=1.0,
    ),  # fmt: skip
}

_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a100-40": "A100-40GB",
    "a100-80": "A100-80GB",
    "h100": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h100-80": "H100-80GB",
    "h200": "H200-141GB",
    "h200-141": "H200-141GB",
    "b200-180gb": "B200",
    "cpu": "cpu-virtual",
}


def find_gpu(name: str) -> GpuType | None:
    """The GPU type with this catalogue name or alias (case-insensitive), or None."""
    if not isinstance(name, str) or not name:
        return None
    key = name.strip().lower()
    for catalog_name, gpu in GPU_CATALOG.items():
        if catalog_name.lower() == key:
            return gpu
    if key in _ALIASES:
        return GPU_CATALOG[_ALIASES[key]]
    return None


# CUDA device names (torch.cuda.get_device_name, e.g. "NVIDIA H100 80GB HBM3") by the family they
# contain, first match wins; peaks are the catalogue's. The L40S (no NVLink) is not a planning target,
# so it has no catalogue entry: NVIDIA L40S datasheet, 362 TFLOP/s bf16 dense.
_DEVICE_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", GPU_CATALOG["H200-141GB"].peak_flops),
    ("H100", GPU_CATALOG["H100-80GB"].peak_flops),
    ("A100", GPU_CATALOG["A100-80GB"].peak_flops),
    ("B200", GPU_CATALOG["B200"].peak_flops),
    ("L40S", 362e12),
)


def peak_flops_of_device(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device by its name; None when unknown (MFU is then not reported)."""
    return next((peak for family, peak in _DEVICE_PEAK_FLOPS if family in device_name), None)
