"""Hardware specs the simulator costs a step against (see :mod:`tidal.sim.analytic`).

Datasheet figures are per device (one GPU): dense bf16/fp16 tensor-core FLOP/s (no sparsity),
HBM bandwidth, NVLink bandwidth per direction (tensor-parallel all-reduce) and the effective
PCIe bandwidth (KV swap to host memory). Sources:

- A100 SXM4: NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS bf16 dense, 1,555 GB/s
  (40GB) / 2,039 GB/s (80GB) HBM2(e), NVLink 3 600 GB/s bidirectional = 300 GB/s per direction,
  PCIe 4.0 x16 (32 GB/s raw per direction, ~25 GB/s seen by cudaMemcpy of pinned memory).
- A800 SXM4 80GB: the export variant of the A100-80GB (NVIDIA A800 Tensor Core GPU datasheet,
  2022): the A100's 312 TFLOPS bf16 dense and 2,039 GB/s HBM2e, NVLink cut to 400 GB/s
  bidirectional = 200 GB/s per direction, PCIe 4.0. KunServe's cluster A (Table 2) is 8 servers
  of one A800 each, 200 Gbps RDMA between them (the ``ib-hdr`` link of :mod:`tidal.sim.links`).
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS bf16 dense (1,979 is with
  sparsity), 3.35 TB/s HBM3, NVLink 4 900 GB/s bidirectional = 450 GB/s per direction,
  PCIe 5.0 x16 (64 GB/s raw, ~50 GB/s effective).
- H800 SXM5 80GB: the export variant of the H100 SXM5 (NVIDIA H800 Tensor Core GPU datasheet,
  2023): the H100's 989 TFLOPS bf16 dense and 80 GB HBM3 at 3.35 TB/s, NVLink cut to 400 GB/s
  bidirectional = 200 GB/s per direction (KunServe's Table 2 lists its cluster B's NVLink as
  300 GB/s one way; the datasheet's figure is used), PCIe 5.0. KunServe's cluster B (Table 2) is 2
  servers of 8 H800, 400 Gbps RDMA between them (``ib-ndr``); Qwen-2.5-72B runs TP 4 (Table 1).
  Its memory total is taken as the H100 80GB's nvidia-smi total (the same HBM3; no H800 at hand).
- H200 SXM: NVIDIA H200 datasheet: the H100's compute (989 TFLOPS bf16 dense), 141 GB HBM3e at
  4.8 TB/s, the same NVLink 4 and PCIe 5.0.

``memory_bytes`` is the total that ``torch.cuda.mem_get_info`` reports (nvidia-smi's total, in
MiB), since that is the ``total`` the engine sizes its KV pool from, not the marketing figure:
A100-SXM4-40GB 40960 MiB and A100-SXM4-80GB 81920 MiB (nvidia-smi's usual totals for these
parts; no A100 was at hand to check), H100 80GB HBM3 81559 MiB and H200 143771 MiB (both read
with nvidia-smi on this workplace's device machines). So the H200's "141 GB" is really about
140 GiB: 143771 MiB = 150.75e9 bytes, not 141e9.

The A100/A800 efficiencies and calibration terms are fitted to published measurements (see
``_A100_CAL`` below). Otherwise the efficiencies, the per-step overhead and ``reserved_bytes``
are OUR choices, not datasheet numbers: compute_efficiency is the fraction of peak a serving engine's GEMMs reach end to end
(0.65 on A100, 0.6 on Hopper whose peak is harder to reach: a lone 8192^3 bf16 GEMM measured on
this workplace's H100 ran at ~800 of 989 TFLOP/s, i.e. 0.81 at best); memory_efficiency is the
fraction of HBM bandwidth a weight/KV streaming kernel sustains (0.8; a device-to-device copy
measured 3.0 of 3.35 TB/s on the H100 here); step_overhead_s is the per-step scheduling, input
preparation, sampling and launch cost of a CUDA-graph engine (1.5 ms); reserved_bytes is the
CUDA context, cuBLAS workspace and allocator slack that the engine sees as "used" (1 GiB);
allreduce_latency_s is the fixed cost of one small NVLink all-reduce (10 us, NCCL ballpark).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import DEFAULT_CPU_KV_MEMORY

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    memory_bytes: int  # device memory total (GPU) or host RAM (CPU)
    peak_flops: float  # dense bf16/fp16 FLOP/s
    mem_bandwidth: float  # B/s, device memory
    interconnect_bandwidth: float  # B/s per direction between devices (tensor-parallel all-reduce)
    host_bandwidth: float  # B/s device <-> host (KV swap)
    compute_efficiency: float  # achieved fraction of peak_flops
    memory_efficiency: float  # achieved fraction of mem_bandwidth (weight reads; KV too unless attn_memory_efficiency)
    step_overhead_s: float  # fixed per-step framework / launch overhead
    reserved_bytes: int  # memory the engine sees as already used besides the weights
    kind: str = "gpu"  # "gpu" | "cpu"
    note: str = ""
    # The KV pool is a fixed budget (the engine on CPU: CacheConfig.kv_cache_memory, default
    # DEFAULT_CPU_KV_MEMORY) when set, otherwise a fraction of memory_bytes less weights,
    # reserved memory and activations (the engine on CUDA).
    kv_budget_bytes: int | None = None
    allreduce_latency_s: float = 0.0  # fixed cost of one all-reduce when tp > 1
    interconnect_efficiency: float = 0.8  # achieved fraction of interconnect_bandwidth (all-reduce, NVLink hand-off)
    # Calibration terms (issue 14, fitted by benchmarks/calibration.py to tidal.sim.reference);
    # the defaults turn each off, giving the plain roofline.
    overlap: float = 1.0  # share of the smaller of the linear layers' compute and weight-read times hidden under the larger
    attn_compute_efficiency: float | None = None  # attention kernels' fraction of peak_flops (None: compute_efficiency)
    attn_memory_efficiency: float | None = None  # paged attention's fraction of mem_bandwidth (None: memory_efficiency)
    attn_self_factor: float = 1.0  # causal self-attention costs this many times its (n^2 + n)/2 pairs (2: the full square)
    attn_seq_tokens: float = 0.0  # each sequence's attention reads as if its context were this many tokens longer
    attn_layer_s: float = 0.0  # fixed attention-kernel time per layer per step (launch, metadata)
    cpu_per_seq_s: float = 0.0  # engine CPU time per sequence in the step, on top of step_overhead_s

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "cpu"):
            raise ValueError(f"hardware {self.name}: kind must be 'gpu' or 'cpu', got {self.kind!r}")
        for f in ("memory_bytes", "peak_flops", "mem_bandwidth", "host_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"hardware {self.name}: {f} must be > 0")
        for f in ("compute_efficiency", "memory_efficiency", "attn_compute_efficiency", "attn_memory_efficiency",
                  "interconnect_efficiency"):
            v = getattr(self, f)
            if v is not None and not 0.0 < v <= 1.0:
                raise ValueError(f"hardware {self.name}: {f} must be in (0, 1]")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"hardware {self.name}: overlap must be in [0, 1]")
        if self.attn_self_factor < 1.0:
            raise ValueError(f"hardware {self.name}: attn_self_factor must be >= 1")
        for f in ("attn_seq_tokens", "attn_layer_s", "cpu_per_seq_s", "step_overhead_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"hardware {self.name}: {f} must be >= 0")

    @property
    def kv_pool_sizing(self) -> str:
        """``"budget"``: the pool is ``kv_budget_bytes`` (CPU engine); ``"fraction"``: it is
        ``utilization * memory_bytes`` less weights, reserved memory and activations (CUDA)."""
        return "budget" if self.kv_budget_bytes is not None else "fraction"


_GPU_COMMON = dict(step_overhead_s=1.5e-3, reserved_bytes=1 * GiB, kind="gpu", allreduce_latency_s=10e-6,
                   memory_efficiency=0.8)

# A100 / A800 (the same silicon): calibrated (issue 14) to Vidur's public A100 profiles of
# vLLM's kernels and CPU path (tidal/sim/reference.py; refit and error table: `tidal bench
# calibrate`). Linear layers reach 68% of peak when compute bound, read weights at 70% of HBM
# bandwidth and hide only 66% of the smaller of the two under the larger; attention reaches
# 34% of peak, pays for a chunk's whole causal square (self factor 2: the mask saves no time),
# reads KV at 75% of bandwidth as if each sequence had 68 more tokens of context, and costs
# 18 us per layer per step besides; the CPU costs 0.83 ms per step plus 42 us per sequence
# (vLLM's schedule/prepare/sample/process path).
# Hopper keeps the plain roofline: no Hopper profile was fitted.
_A100_CAL = dict(_GPU_COMMON, compute_efficiency=0.68, memory_efficiency=0.70, overlap=0.66,
                 attn_compute_efficiency=0.34, attn_self_factor=2.0, attn_memory_efficiency=0.75, attn_seq_tokens=68.0,
                 attn_layer_s=18e-6, step_overhead_s=0.83e-3, cpu_per_seq_s=42e-6)

HARDWARE: dict[str, HardwareSpec] = {
    "a100-40g": HardwareSpec(
        name="a100-40g", memory_bytes=40960 * MiB, peak_flops=312e12, mem_bandwidth=1.555e12,
        interconnect_bandwidth=300e9, host_bandwidth=25e9,
        note="NVIDIA A100-SXM4-40GB, HBM2, NVLink 3, PCIe 4.0", **_A100_CAL),
    "a100-80g": HardwareSpec(
        name="a100-80g", memory_bytes=81920 * MiB, peak_flops=312e12, mem_bandwidth=2.039e12,
        interconnect_bandwidth=300e9, host_bandwidth=25e9,
        note="NVIDIA A100-SXM4-80GB, HBM2e, NVLink 3, PCIe 4.0", **_A100_CAL),
    "a800-80g": HardwareSpec(
        name="a800-80g", memory_bytes=81920 * MiB, peak_flops=312e12, mem_bandwidth=2.039e12,
        interconnect_bandwidth=200e9, host_bandwidth=25e9,
        note="NVIDIA A800-SXM4-80GB: A100-80GB compute and HBM2e, NVLink 400 GB/s bidirectional, PCIe 4.0",
        **_A100_CAL),
    "h100-80g": HardwareSpec(
        name="h100-80g", memory_bytes=81559 * MiB, peak_flops=989e12, mem_bandwidth=3.35e12,
        interconnect_bandwidth=450e9, host_bandwidth=50e9, compute_efficiency=0.6,
        note="NVIDIA H100 SXM5 80GB HBM3, NVLink 4, PCIe 5.0", **_GPU_COMMON),
    "h800-80g": HardwareSpec(
        name="h800-80g", memory_bytes=81559 * MiB, peak_flops=989e12, mem_bandwidth=3.35e12,
        interconnect_bandwidth=200e9, host_bandwidth=50e9, compute_efficiency=0.6,
        note="NVIDIA H800 SXM5 80GB: H100 SXM5 compute and HBM3, NVLink 400 GB/s bidirectional, PCIe 5.0",
        **_GPU_COMMON),
    "h200": HardwareSpec(
        name="h200", memory_bytes=143771 * MiB, peak_flops=989e12, mem_bandwidth=4.8e12,
        interconnect_bandwidth=450e9, host_bandwidth=50e9, compute_efficiency=0.6,
        note="NVIDIA H200 SXM 141GB HBM3e, NVLink 4, PCIe 5.0", **_GPU_COMMON),
    # This development machine: 2 cores of an AMD EPYC with AVX-512 BF16, 25.3e9 bytes of RAM.
    # peak_flops: results/offline.json "peak" (`tidal bench offline`, other core idle): a 2048^3
    # bf16 torch matmul on both cores ran at 765 GFLOP/s, a skinny 32x576x2304 one (a SmolLM2
    # projection) at 368, hence compute_efficiency 0.5 for the model's matmuls. mem_bandwidth:
    # np.copyto of a 256 MiB float64 array split over 2 threads (numpy releases the GIL), median
    # of 5 runs after a warm-up, counting bytes read + written: 37.1 GB/s (1 thread: 34-35 GB/s);
    # memory_efficiency 0.9 since that is already an achieved rate. host_bandwidth: a KV swap on
    # CPU is a memory-to-memory copy, so half that (each byte is read once and written once).
    # step_overhead_s 10 ms: results/offline.json workload c (SmolLM2, batch 1) decoded at a
    # median 18.9 ms per step, of which this model puts 8.2 ms on weight and KV streaming. Batched
    # CPU steps come out too fast (workload b, 32 decodes: 36 ms predicted vs 50 ms measured;
    # a, 64 decodes at longer contexts: 75 vs 127 ms): the engine's CPU attention and small
    # matmuls fall short of any roofline; use tidal.sim.profiled where CPU step times matter.
    # No interconnect: tp must be 1.
    "cpu": HardwareSpec(
        name="cpu", memory_bytes=25276510208, peak_flops=765e9, mem_bandwidth=37.1e9,
        interconnect_bandwidth=0.0, host_bandwidth=18.5e9, compute_efficiency=0.5,
        memory_efficiency=0.9, step_overhead_s=10e-3, reserved_bytes=0, kind="cpu",
        kv_budget_bytes=DEFAULT_CPU_KV_MEMORY,
        note="2-core AMD EPYC (AVX-512 BF16), measured on the development machine"),
}


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; valid names: {', '.join(HARDWARE)}") from None


__all__ = ["HARDWARE", "HardwareSpec", "get_hardware"]
