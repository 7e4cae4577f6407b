"""Links a prefill-to-decode KV hand-off can travel on, and what a chunk costs on each.

A hand-off moves its KV in chunks (:func:`tidal.cluster.handoff.plan_chunks`), one after the
other on the sending instance's link; each chunk costs ``latency_s + bytes / (tp * bandwidth)``
(with tensor parallelism every GPU sends its own shard on its own link). ``bandwidth`` is one
direction, as achieved; ``latency_s`` is the fixed cost of one chunk (launching the copy, its
completion, the control message that announces it).

Bandwidths, from the datasheets:

- ``nvlink``: the GPU's NVLink, per direction, from :mod:`tidal.sim.hardware` (NVIDIA A100
  datasheet: NVLink 3 600 GB/s bidirectional = 300 GB/s each way; H100 / H200 datasheets: NVLink 4
  900 GB/s = 450 GB/s each way), times the hardware's ``interconnect_efficiency`` (0.8), the fraction
  the analytic model already charges its all-reduces on the same links.
- ``pcie``: the GPU's host link as the hardware records it (A100: PCIe 4.0 x16, 64 GB/s
  bidirectional in the datasheet, ~25 GB/s achieved per direction by a pinned cudaMemcpy;
  H100 / H200: PCIe 5.0 x16, ~50 GB/s), already an achieved figure.
- ``ib-hdr`` / ``ib-ndr``: InfiniBand HDR 200 Gb/s (NVIDIA ConnectX-6 datasheet: 200 Gb/s per
  port, sub-600 ns port-to-port latency) and NDR 400 Gb/s (ConnectX-7), one NIC per GPU as in a
  DGX A100 / H100 (8 NICs for 8 GPUs), times 0.9 for RDMA and GPUDirect overheads.
- ``eth-100g``: 100 Gb/s Ethernet (IEEE 802.3 100GBASE), times 0.8 (TCP).
- ``shm``: POSIX shared memory between two processes of this development machine, what the CPU
  runtime's ``shm`` transport does (put = copy in, get = copy out). ``tidal bench kv-transfer
  --transports shm --model-shape smollm2-135m --dtype bfloat16 --tokens 16,64,256,1024
  --layers-per-chunk 30 --repeats 20`` measured 393 MB/s (16 tokens) and 755 MB/s (64) put-to-get,
  but only 157 MB/s for 5.9 and 23.6 MB chunks while the 2 cores were shared (llama-3-8b
  shapes: 724 MB/s at 0.5 MB, 21-86 MB/s at 8-34 MB). We take 400 MB/s and 0.3 ms per chunk
  (attach, release and the control message: the 16-token release alone took 0.13 ms).

The per-chunk latencies are OUR choices, not datasheet figures: 10 us on NVLink and PCIe (a
peer copy's launch and completion, the figure hardware.py charges a small all-reduce), 20 us
on InfiniBand (posting an RDMA write of registered GPU memory, its completion, and the
announcement; the wire itself is ~1 us), 50 us on TCP over Ethernet.

The default is ``nvlink`` on a GPU: BucketServe's testbed is one node of 4 A100-40G on NVLink,
and its P/D scheduler moves the KV "via NVLink" (Sec. III, Sec. V.A); ``shm`` on the CPU.
Pure (no torch, no clock).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.sim.hardware import HardwareSpec

LINK_NAMES = ("nvlink", "pcie", "ib-hdr", "ib-ndr", "eth-100g", "shm")
SHM_BANDWIDTH = 400e6  # B/s, measured here (see above)
SHM_LATENCY_S = 0.3e-3


@dataclass(frozen=True)
class LinkSpec:
    name: str
    bandwidth: float  # achieved bytes/s, one direction, per GPU
    latency_s: float  # fixed cost of one chunk
    note: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0")
        if self.latency_s < 0:
            raise ValueError(f"link {self.name}: latency must be >= 0")

    def chunk_time(self, nbytes: float, tp: int = 1) -> float:
        """Seconds to move one chunk of ``nbytes`` (all ``tp`` shards, each on its own link)."""
        return self.latency_s + nbytes / (self.bandwidth * tp)

    def to_dict(self) -> dict:
        return {"name": self.name, "bandwidth_gb_s": self.bandwidth / 1e9, "latency_us": self.latency_s * 1e6,
                "note": self.note}


def default_link(hw: HardwareSpec) -> str:
    return "nvlink" if hw.kind == "gpu" else "shm"


def get_link(name: str | None, hw: HardwareSpec) -> LinkSpec:
    """The link ``name`` between two instances on ``hw`` (None: :func:`default_link`)."""
    name = name or default_link(hw)
    if name in ("nvlink", "pcie") and hw.kind != "gpu":
        raise ValueError(f"the {hw.name} hardware has no {name}; links for it: shm, ib-hdr, ib-ndr, eth-100g")
    if name == "nvlink":
        if hw.interconnect_bandwidth <= 0:
            raise ValueError(f"hardware {hw.name} has no NVLink bandwidth")
        return LinkSpec("nvlink", hw.interconnect_bandwidth * hw.interconnect_efficiency, 10e-6,
                        f"NVLink of {hw.name}: {hw.interconnect_bandwidth / 1e9:g} GB/s per direction x "
                        f"{hw.interconnect_efficiency:g}")
    if name == "pcie":
        return LinkSpec("pcie", hw.host_bandwidth, 10e-6, f"PCIe of {hw.name}: {hw.host_bandwidth / 1e9:g} GB/s achieved")
    if name == "ib-hdr":
        return LinkSpec("ib-hdr", 200e9 / 8 * 0.9, 20e-6, "InfiniBand HDR 200 Gb/s x 0.9, one NIC per GPU")
    if name == "ib-ndr":
        return LinkSpec("ib-ndr", 400e9 / 8 * 0.9, 20e-6, "InfiniBand NDR 400 Gb/s x 0.9, one NIC per GPU")
    if name == "eth-100g":
        return LinkSpec("eth-100g", 100e9 / 8 * 0.8, 50e-6, "100 Gb/s Ethernet x 0.8 (TCP)")
    if name == "shm":
        return LinkSpec("shm", SHM_BANDWIDTH, SHM_LATENCY_S, "shared memory between processes, measured here")
    raise ValueError(f"unknown link {name!r}; valid names: {', '.join(LINK_NAMES)}")


__all__ = ["LINK_NAMES", "LinkSpec", "default_link", "get_link"]
