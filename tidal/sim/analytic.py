"""Analytic step-time model: a roofline over a model shape and a hardware spec.

One engine step runs every chunk of the plan through the model once. Its time is

    t = linear + attention + all-reduce + swap + step_overhead_s + cpu_per_seq_s * sequences

- **linear** (the projections and MLP of every layer, and the LM head for the sampled chunks),
  one roofline for the whole step: ``max(flops / F, bytes / B)`` with
  ``flops = 2 * layer_params * tokens + 2 * hidden * vocab * sampled`` and ``bytes`` the layer
  weights (read once per step whatever the batch) plus the LM head when anything is sampled.
  This is KunServe Eq. 1's ``beta * c`` (compute bound) and the weight-read part of its
  ``gamma`` (memory bound). Activation traffic is ignored: it matters only where the step is
  compute bound anyway.
- **attention**, one roofline per chunk (KunServe Eq. 1's ``alpha`` terms): a chunk of ``c``
  tokens after a prefix of ``p`` attends over ``pairs = p*c + (c*c + c)/2`` (query, key) pairs
  (prefix-attn + causal self-attn), each costing ``4 * head_dim`` FLOPs (QK^T and PV) per query
  head per layer; it reads the KV of ``p + c`` tokens (all layers). Per chunk rather than
  summed, so a memory-bound decode next to a compute-bound prefill is not hidden under it:
  the conservative choice, equal to the summed one when all chunks are on one side of the ridge.
  Calibration terms (A100, fitted to Vidur's kernel profiles, :mod:`tidal.sim.reference`):
  attention's own fractions of peak FLOP/s and bandwidth, the self pairs counted
  ``attn_self_factor`` times (2: a causal kernel pays for its whole square), each chunk reading
  ``attn_seq_tokens`` more tokens of KV than it has (so short contexts reach less bandwidth),
  and ``attn_layer_s`` per layer per step.
- **CPU**: ``step_overhead_s`` per step plus ``cpu_per_seq_s`` per sequence in it (scheduling,
  input preparation, sampling, output processing; Vidur's vLLM CPU profile on A100 hosts).
- **tensor parallel** ``tp``: FLOPs, weight and KV bytes split over ``tp`` devices; plus two
  ring all-reduces per layer of ``tokens * hidden * dtype_bytes`` each, moving ``2(tp-1)/tp`` of
  that over the interconnect (at ``interconnect_efficiency``), plus a fixed latency per all-reduce.
  Query heads must divide by ``tp``; KV heads fewer than ``tp`` (replicated) are not modelled.
- **swap**: ``(len(swap_out) + len(swap_in)) * block_bytes / tp / host_bandwidth`` (each device
  moves its shard of a block over its own PCIe link).

- **padding** (static batching that pads, ``composition.num_padded_tokens`` > 0, BucketServe
  Eq. 1's S_max x N): the step is a rectangle of ``rows = (tokens + padded) / longest`` rows, each
  the step's longest chunk (``longest`` tokens) at its longest prefix, in place of the chunks; a
  dead row (a finished member) is one decode at the longest context. The padded tokens cost the
  linear layers and attention like real ones.

F and B are ``peak * efficiency`` of the hardware, times ``tp``. A plan with no chunks costs
only its swaps (0.0 when it has none): no step is launched.

Speed: ``step_time`` loops once over the chunks with constants folded in ``__init__`` (seconds
per FLOP and per byte), about 0.17 us per chunk: 2.2-3.3 us for a 16-chunk plan, 0.35-0.45 us
for one decode, ~44 us for 256 decodes (timeit, best of 5, CPython 3.11 on the shared 2-core
development machine, so the spread is load). :meth:`breakdown` is the readable
reference the tests compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.config import (
    ConfigError,
    ModelArch,
    activation_reserve_bytes,
    kv_pool_blocks,
)
from tidal.core.plan import StepPlan
from tidal.sim.hardware import GiB, HardwareSpec


def weight_bytes(arch: ModelArch, dtype_bytes: int) -> int:
    """Bytes of all the model's weights (embedding, layers, LM head unless tied, final norm)."""
    return arch.num_params() * dtype_bytes


class AnalyticCostModel:
    name = "analytic"

    def __init__(self, arch: ModelArch, hardware: HardwareSpec, dtype_bytes: int = 2, tp: int = 1,
                 block_size: int = 16):
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if tp > 1 and hardware.interconnect_bandwidth <= 0:
            raise ValueError(f"hardware {hardware.name} has no interconnect: tensor parallel (tp={tp}) "
                             "needs tp=1 there")
        if arch.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide the {arch.num_heads} attention heads of {arch.name}")
        if dtype_bytes <= 0 or block_size <= 0:
            raise ValueError("dtype_bytes and block_size must be > 0")
        self.arch, self.hardware = arch, hardware
        self.dtype_bytes, self.tp, self.block_size = dtype_bytes, tp, block_size
        h, L = arch.hidden_size, arch.num_layers
        flops = hardware.peak_flops * hardware.compute_efficiency * tp  # achieved FLOP/s, all devices
        bw = hardware.mem_bandwidth * hardware.memory_efficiency * tp  # achieved B/s, all devices
        self.layer_params = L * arch.params_per_layer()
        self.head_params = h * arch.vocab_size
        self.kv_bytes_per_token = arch.kv_bytes_per_token(dtype_bytes)
        self.block_bytes = block_size * self.kv_bytes_per_token
        self.attn_flops_per_pair = 4 * arch.head_dim * arch.num_heads * L
        # seconds per unit, folded for the hot path
        self._s_per_token_linear = 2 * self.layer_params / flops
        self._s_per_sample_head = 2 * self.head_params / flops
        self._s_layer_weights = self.layer_params * dtype_bytes / bw
        self._s_head_weights = self.head_params * dtype_bytes / bw
        # attention kernels: their own fractions of peak, a per-sequence read overhead and a fixed
        # time per layer per step (calibration terms of HardwareSpec; defaults give the roofline)
        a_eff_c = hardware.attn_compute_efficiency or hardware.compute_efficiency
        a_eff_m = hardware.attn_memory_efficiency or hardware.memory_efficiency
        self._s_per_pair = self.attn_flops_per_pair / (hardware.peak_flops * a_eff_c * tp)
        self._s_per_kv_token = self.kv_bytes_per_token / (hardware.mem_bandwidth * a_eff_m * tp)
        self._seq_tokens = hardware.attn_seq_tokens
        self._self_half = 0.5 * hardware.attn_self_factor  # KunServe Eq. 1's self-attn (c^2 + c)/2, scaled
        self._attn_fixed = L * hardware.attn_layer_s
        self._hidden = hardware.overlap  # share of min(compute, memory) of the linear layers hidden
        self._s_per_seq = hardware.cpu_per_seq_s
        if tp > 1:
            link = hardware.interconnect_bandwidth * hardware.interconnect_efficiency
            ring = 2 * (tp - 1) / tp
            self._s_per_token_allreduce = 2 * L * h * dtype_bytes * ring / link
            self._s_allreduce_fixed = 2 * L * hardware.allreduce_latency_s
        else:
            self._s_per_token_allreduce = 0.0
            self._s_allreduce_fixed = 0.0
        self._s_per_swap_block = self.block_bytes / tp / hardware.host_bandwidth
        self._overhead = hardware.step_overhead_s

    def __repr__(self) -> str:
        return (f"AnalyticCostModel({self.arch.name or self.arch.architecture}, {self.hardware.name}, "
                f"dtype_bytes={self.dtype_bytes}, tp={self.tp})")

    def step_time(self, plan: StepPlan) -> float:
        chunks = plan.chunks
        swaps = len(plan.swap_out) + len(plan.swap_in)
        if not chunks:
            return swaps * self._s_per_swap_block if swaps else 0.0
        if plan.composition.num_padded_tokens:
            return self._padded_step_time(plan, swaps)
        s_pair = self._s_per_pair
        s_kv = self._s_per_kv_token
        extra = self._seq_tokens
        half = self._self_half
        tokens = 0
        sampled = 0
        attn = self._attn_fixed
        for c in chunks:
            n = len(c.token_ids)
            p = c.start
            tc = s_pair * (p * n + (n * n + n) * half)
            tm = s_kv * (p + n + extra)
            attn += tc if tc > tm else tm
            tokens += n
            if c.sample:
                sampled += 1
        return self._rest(attn, tokens, sampled, len(chunks), swaps)

    def _rest(self, attn: float, tokens: int, sampled: int, seqs: int, swaps: int) -> float:
        """A step's time around its attention: the linear layers (partial overlap), all-reduces,
        swaps, the fixed and per-sequence CPU time."""
        tc = self._s_per_token_linear * tokens + self._s_per_sample_head * sampled
        tm = self._s_layer_weights + self._s_head_weights if sampled else self._s_layer_weights
        linear = tc + (1.0 - self._hidden) * tm if tc > tm else tm + (1.0 - self._hidden) * tc
        return (linear + attn + self._s_per_token_allreduce * tokens + self._s_allreduce_fixed
                + swaps * self._s_per_swap_block + self._overhead + self._s_per_seq * seqs)

    def decode_step_time(self, positions: Sequence[tuple[str, int]]) -> float:
        """:meth:`step_time` of a step in which each request decodes one token, at the positions of
        ``(request id, position)`` pairs (all sample; no swaps, no padding): the same arithmetic,
        without a plan."""
        return self.decode_step_time_at([p for _, p in positions], 0)

    def decode_step_time_at(self, positions: Sequence[int], ahead: int) -> float:
        """:meth:`decode_step_time` with each request at ``position + ahead`` (``ahead`` steps later)."""
        s_pair = self._s_per_pair
        s_kv = self._s_per_kv_token
        self_pairs = 2.0 * self._self_half  # step_time's (n * n + n) * half with n = 1
        kv_extra = 1 + self._seq_tokens
        attn = self._attn_fixed
        for p in positions:
            p += ahead
            tc = s_pair * (p + self_pairs)
            tm = s_kv * (p + kv_extra)
            attn += tc if tc > tm else tm
        n = len(positions)
        return self._rest(attn, n, n, n, 0)

    def _rectangle(self, plan: StepPlan) -> tuple[int, int, int, int]:
        """(rows, longest chunk, longest prefix, sampled rows) of a padded step."""
        longest = max(c.num_tokens for c in plan.chunks)
        prefix = max(c.start for c in plan.chunks)
        rows = -(-(plan.num_tokens + plan.composition.num_padded_tokens) // longest)
        sampled = sum(1 for c in plan.chunks if c.sample) + rows - len(plan.chunks)
        return rows, longest, prefix, sampled

    def _linear(self, tc: float, tm: float) -> float:
        """The linear layers' roofline with partial overlap: the larger time plus the unhidden
        share of the smaller (``overlap`` 1: perfect overlap, the plain max)."""
        return max(tc, tm) + (1.0 - self._hidden) * min(tc, tm)

    def _padded_step_time(self, plan: StepPlan, swaps: int) -> float:
        rows, n, p, sampled = self._rectangle(plan)
        tokens = rows * n
        a_c = self._s_per_pair * (p * n + (n * n + n) * self._self_half)
        a_m = self._s_per_kv_token * (p + n + self._seq_tokens)
        tc = self._s_per_token_linear * tokens + self._s_per_sample_head * sampled
        tm = self._s_layer_weights + (self._s_head_weights if sampled else 0.0)
        return (self._linear(tc, tm) + self._attn_fixed + rows * max(a_c, a_m) + self._s_per_token_allreduce * tokens
                + self._s_allreduce_fixed + swaps * self._s_per_swap_block + self._overhead + self._s_per_seq * rows)

    def breakdown(self, plan: StepPlan) -> dict[str, float]:
        """The step's time by part (seconds), with the bound each roofline hit. Slow; for tests
        and reports. ``total`` equals :meth:`step_time`."""
        swaps = len(plan.swap_out) + len(plan.swap_in)
        swap = swaps * self._s_per_swap_block
        if not plan.chunks:
            return {"linear": 0.0, "attention": 0.0, "allreduce": 0.0, "swap": swap, "overhead": 0.0,
                    "total": swap, "linear_bound": "none", "attention_compute_chunks": 0}
        if plan.composition.num_padded_tokens:
            total = self._padded_step_time(plan, swaps)
            return {"linear": float("nan"), "attention": float("nan"), "allreduce": float("nan"), "swap": swap,
                    "overhead": self._overhead + self._s_per_seq * self._rectangle(plan)[0], "total": total,
                    "linear_bound": "padded",
                    "attention_compute_chunks": 0, "padded_rows": self._rectangle(plan)[0]}
        flops_all = self.hardware.peak_flops * self.hardware.compute_efficiency * self.tp
        bw_all = self.hardware.mem_bandwidth * self.hardware.memory_efficiency * self.tp
        tokens = sum(c.num_tokens for c in plan.chunks)
        sampled = sum(1 for c in plan.chunks if c.sample)
        lin_flops = 2 * self.layer_params * tokens + 2 * self.head_params * sampled
        lin_bytes = (self.layer_params + (self.head_params if sampled else 0)) * self.dtype_bytes
        lin_c, lin_m = lin_flops / flops_all, lin_bytes / bw_all
        attention, compute_chunks = self._attn_fixed, 0
        for c in plan.chunks:
            p, n = c.start, c.num_tokens
            pairs = p * n + (n * n + n) * self._self_half  # KunServe Eq. 1: prefix-attn + self-attn
            a_c = self._s_per_pair * pairs
            a_m = self._s_per_kv_token * (p + n + self._seq_tokens)
            attention += max(a_c, a_m)
            compute_chunks += a_c > a_m
        allreduce = self._s_per_token_allreduce * tokens + self._s_allreduce_fixed
        linear = self._linear(lin_c, lin_m)
        overhead = self._overhead + self._s_per_seq * len(plan.chunks)
        total = linear + attention + allreduce + swap + overhead
        return {"linear": linear, "attention": attention, "allreduce": allreduce, "swap": swap,
                "overhead": overhead, "total": total,
                "linear_bound": "compute" if lin_c > lin_m else "memory",
                "attention_compute_chunks": compute_chunks}


def kv_pool_blocks_for(arch: ModelArch, hardware: HardwareSpec, dtype_bytes: int = 2, tp: int = 1,
                       block_size: int = 16, max_num_batched_tokens: int = 512, utilization: float = 0.9,
                       kv_cache_memory: int | None = None) -> int:
    """KV blocks (of ``block_size`` tokens, all layers, all ``tp`` shards) of a simulated instance,
    sized with :func:`tidal.config.kv_pool_blocks` the way the engine sizes its own pool.

    An explicit ``kv_cache_memory`` wins, as in the engine; on hardware whose pool is a fixed
    budget (``cpu``: ``DEFAULT_CPU_KV_MEMORY``) that budget is used, as by the engine on CPU.
    Otherwise, as on CUDA: ``total = memory_bytes * tp``, ``used = weights + reserved_bytes * tp``
    and ``activations = activation_reserve_bytes(arch, max_num_batched_tokens) * tp`` (each device
    holds one step's activations; for tp=1 exactly the engine's formula). Raises
    :class:`~tidal.config.ConfigError` when the weights do not fit.
    """
    if tp < 1:
        raise ConfigError(f"tp must be >= 1, got {tp}")
    block_bytes = block_size * arch.kv_bytes_per_token(dtype_bytes)
    weights = weight_bytes(arch, dtype_bytes)
    total = hardware.memory_bytes * tp
    where = f"{tp} x {hardware.name}" if tp > 1 else hardware.name
    label = arch.name or arch.architecture
    if weights > total:
        raise ConfigError(f"{label} weights ({weights / GiB:.1f} GiB at {dtype_bytes} bytes/param) do not fit "
                          f"in {where} ({total / GiB:.1f} GiB); use a larger tp or bigger hardware")
    budget = kv_cache_memory if kv_cache_memory is not None else hardware.kv_budget_bytes
    if budget is not None:
        return kv_pool_blocks(block_bytes, kv_cache_memory=budget)
    used = weights + hardware.reserved_bytes * tp
    act = activation_reserve_bytes(arch, max_num_batched_tokens) * tp
    usable = int(total * utilization)
    if used + act + block_bytes > usable:
        raise ConfigError(
            f"{label} weights ({weights / GiB:.1f} GiB) plus reserved memory ({hardware.reserved_bytes * tp / GiB:.1f}"
            f" GiB) and activations ({act / GiB:.1f} GiB) leave no room for a KV block in {where} at "
            f"utilization {utilization} ({usable / GiB:.1f} GiB usable); use a larger tp or bigger hardware")
    return kv_pool_blocks(block_bytes, total_bytes=total, utilization=utilization, used_bytes=used,
                          activation_bytes=act)


__all__ = ["AnalyticCostModel", "kv_pool_blocks_for", "weight_bytes"]
