"""Configuration dataclasses: the one source of defaults for tidal.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with a
message naming the offending field. The environment is read through :func:`env_str` only,
but for the native kernels' two switches, read where the kernels load (``TIDAL_NATIVE_SIMD``,
``TIDAL_NO_NATIVE`` in :mod:`tidal.engine.native`).
Pure Python: no torch here, so the simulator and the policies can import it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: str | int | float, name: str = "size") -> int:
    """Parse a memory size such as ``512MiB``, ``2GB`` or ``1048576`` into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size like 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{name}: cannot parse {value!r} as a size (examples: 512MiB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def env_str(name: str, default: str | None = None) -> str | None:
    """Where tidal reads the environment (but for tidal.engine.native's two switches)."""
    return os.environ.get(name, default)


# --------------------------------------------------------------------------------------------
# Model architecture (shape) -- shared by the engine (to build the model) and the simulator
# (to cost it). Field names follow the Hugging Face Llama config where one exists.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelArch:
    architecture: str  # "llama" | "qwen2" | "mistral" ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    mlp_matrices: int = 3  # 3 = gated MLP (SwiGLU: gate, up, down), 2 = plain (fc1, fc2: OPT)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model {f} must be > 0, got {getattr(self, f)}")
        if self.mlp_matrices not in (2, 3):
            raise ConfigError(f"model mlp_matrices must be 2 (plain) or 3 (gated), got {self.mlp_matrices}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    # ---- sizes used by the memory planner and the cost model ----
    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def params_per_layer(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = self.mlp_matrices * h * self.intermediate_size
        return attn + mlp + 2 * h

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return emb + head + self.num_layers * self.params_per_layer() + self.hidden_size


# --------------------------------------------------------------------------------------------
# Engine configuration
# --------------------------------------------------------------------------------------------
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION = ("auto", "none", "int4")  # tidal.engine.quant
PREEMPTION_MODES = ("recompute", "swap")
# chunked: prefill chunks share a step with the decodes (vLLM v1); prefill-first: a step is all prefills,
# each whole, or all decodes, prefills first (vLLM v0's default scheduler)
SCHEDULING_MODES = ("chunked", "prefill-first")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: Triton on CUDA, tidal's C++ kernels on CPU float32
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # auto: the model's dtype


@dataclass
class ModelConfig:
    model: str | None = None  # path to a .gguf file or an HF directory; None = default model
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU bf16 where native and timed faster, else float32
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0
    num_threads: int | None = None  # CPU intra-op threads; default: all cores
    layer_range: tuple[int, int] | None = None  # build only layers [start, end) (a pipeline stage)
    quantization: str = "auto"  # int4 kernels for 4-bit stored weights: auto (where faster) | none | int4
    compile: bool = False  # steps of decodes as torch.compile graphs (tidal.engine.compiled)
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs (tidal.engine.cuda_graph)
    # decode steps on CUDA graphs run ahead of the host, the next planned while one computes
    # (tidal.engine.engine_core.EngineCore.step)
    async_scheduling: bool = False
    attention_backend: str = "auto"  # auto | torch | triton (tidal.engine.triton_attention)

    def __post_init__(self) -> None:
        for name in ("compile", "enforce_eager", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}; "
                              f"got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATION:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION)}; got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ConfigError(f"num_threads must be > 0, got {self.num_threads}")
        if self.layer_range is not None:
            a, b = self.layer_range
            if not 0 <= a < b:
                raise ConfigError(f"layer_range must be [start, end) with 0 <= start < end; got {self.layer_range}")


DEFAULT_CPU_KV_MEMORY = 512 * 1024**2  # the KV pool on CPU when no budget is given
DEFAULT_SWAP_SPACE = 4 * 1024**3  # host memory for swapped-out KV, per instance: vLLM's default (4 GiB per GPU)


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # bytes for the KV pool on CPU (default DEFAULT_CPU_KV_MEMORY)
    gpu_memory_utilization: float = 0.9  # fraction of free GPU memory for weights+KV on CUDA
    swap_space: int | str = DEFAULT_SWAP_SPACE  # host memory for swapped-out KV blocks (used in swap mode only)
    num_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | float32 | bfloat16 | float16
    # automatic prefix caching (vLLM's --enable-prefix-caching, on by default there too): full KV blocks
    # named by a chained hash, kept after their last user until reused
    enable_prefix_caching: bool = True
    # host memory (bytes; vLLM's --kv-offloading-size, given in GiB there) for a second tier of cached
    # blocks: what the pool evicts is copied there and loaded back on a hit; 0 = none
    kv_offloading_size: int | str = 0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
            if self.kv_cache_memory <= 0:
                raise ConfigError("kv_cache_memory must be > 0")
        self.swap_space = parse_size(self.swap_space, "swap_space")
        self.kv_offloading_size = parse_size(self.kv_offloading_size, "kv_offloading_size")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size keeps cached prefix blocks in host memory: it needs prefix caching "
                              "(drop --no-enable-prefix-caching, or the offloading size)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks_override is not None and self.num_blocks_override <= 0:
            raise ConfigError(f"num_blocks_override must be > 0, got {self.num_blocks_override}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # most requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill)
    long_prefill_token_threshold: int = 0  # 0 = a single prefill may take the whole budget
    preemption_mode: str = "recompute"
    # keep the host pool for swap (swap_space) even while preempting by recompute: a cluster decision
    # (--kv-pressure auto) switches an instance's preemption mode at run time (Scheduler.preemption_mode)
    swap_pool: bool = False
    scheduling: str = "chunked"  # one of SCHEDULING_MODES
    # the prefill chunks of a step run as a padded rectangle (every row as long as the longest), as
    # an engine without variable-length attention batches prompts (BucketServe Sec. II's padding)
    pad_prefill: bool = False
    batching: str = "continuous"  # policy name(s) from tidal.policies, joined with "+"
    max_queued_requests: int | None = None  # bounded waiting queue (server); None = unbounded
    tbt_slo_ms: float | None = None  # decode-latency SLO the SLA / SLO-aware policies aim for
    # "bucket.theta": 0.5, "sla.alpha": ...; checked against each policy's typed parameters when
    # the policy is built (tidal.policies.build_policy)
    policy_args: dict[str, Any] = field(default_factory=dict)
    # KunServe Eq. 1's (alpha, beta, gamma) for a pipeline group's microbatch split, profiled by
    # `tidal profile` (`tidal serve --profile`); None: FLOP ratios of the model's shape
    microbatch_cost: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {self.preemption_mode!r}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ConfigError(
                f"scheduling must be one of {', '.join(SCHEDULING_MODES)}; got {self.scheduling!r}")
        if self.pad_prefill and self.scheduling != "prefill-first":
            raise ConfigError("pad_prefill pads a step of prompts: it needs prefill-first scheduling (a chunked "
                              "step mixes decodes into its prefill)")
        if self.scheduling == "prefill-first" and self.long_prefill_token_threshold:
            raise ConfigError("long_prefill_token_threshold caps a prefill chunk; prefill-first scheduling "
                              "runs every prefill whole (leave it 0)")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError("max_queued_requests must be >= 0")
        if self.tbt_slo_ms is not None and self.tbt_slo_ms <= 0:
            raise ConfigError(f"tbt_slo_ms must be > 0, got {self.tbt_slo_ms}")
        if isinstance(self.policy_args, (list, tuple)):  # ["bucket.theta=0.5", ...] from the CLI
            self.policy_args = parse_policy_args(self.policy_args)
        if self.microbatch_cost is not None:
            mc = tuple(float(v) for v in self.microbatch_cost)
            if len(mc) != 3 or min(mc) < 0 or not any(mc[:2]):
                raise ConfigError(f"microbatch_cost must be (alpha, beta, gamma) >= 0 with alpha or beta > 0, "
                                  f"got {self.microbatch_cost!r}")
            self.microbatch_cost = mc  # type: ignore[assignment]


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., max_num_seqs=...)``, CLI flags)."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        owners = {
            f.name: part for part, klass in (("model", ModelConfig), ("cache", CacheConfig),
                                             ("scheduler", SchedulerConfig)) for f in fields(klass)
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise ConfigError(f"unknown engine argument {key!r}")
            if value is not None or key == "model":
                parts[owners[key]][key] = value
        return cls(ModelConfig(**parts["model"]), CacheConfig(**parts["cache"]),
                   SchedulerConfig(**parts["scheduler"]))


def parse_policy_args(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"policy argument {item!r}: expected NAME=VALUE, e.g. sla.d_sla_ms=50")
        out[key.strip()] = value.strip()
    return out


# The offline entry point (tidal.LLM, and so `tidal bench offline`) takes a larger step budget than the
# server's 512, as vLLM's LLM class does (8192 there against 2048 for its API server): no request waits
# on a step there, and fewer, larger steps measured 1.03x (b) and 1.05x (a) at 2048 on a 2-core Xeon
# (4096 was no better), 2026-11-25.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


def activation_reserve_bytes(arch: ModelArch, max_num_batched_tokens: int) -> int:
    """Memory held back from the KV pool on a GPU for one step's activations (fp32 upper bound):
    the widest MLP and logits buffers for a full token budget."""
    return max_num_batched_tokens * (4 * arch.intermediate_size + 4 * arch.vocab_size) * 4


def kv_pool_blocks(block_bytes: int, *, kv_cache_memory: int | None = None, total_bytes: int | None = None,
                   utilization: float = 0.9, used_bytes: int = 0, activation_bytes: int = 0) -> int:
    """Blocks in the KV pool, the one formula the engine and the simulator share.

    An explicit ``kv_cache_memory`` budget wins (the CPU default). Otherwise the pool is what
    ``utilization`` of the device leaves after what is already used (weights) and one step's
    activations: ``(total * utilization - used - activations) // block_bytes``.
    """
    if kv_cache_memory is not None:
        budget = kv_cache_memory
    elif total_bytes is not None:
        budget = int(total_bytes * utilization) - used_bytes - activation_bytes
    else:
        raise ConfigError("the KV pool needs kv_cache_memory or the device's total memory")
    n = budget // block_bytes
    if n < 1:
        raise ConfigError(f"the KV cache budget ({budget} bytes) holds no block of {block_bytes} bytes "
                          f"(weights and activations take {used_bytes + activation_bytes} bytes)")
    return int(n)


def swap_space_warning(host_blocks: int, block_size: int, max_model_len: int, swap_space: int) -> str | None:
    """What to say at start-up when ``--preemption-mode swap``'s host pool (``host_blocks`` blocks of
    ``block_size`` tokens, ``swap_space`` bytes) cannot hold one request of ``max_model_len`` tokens:
    a preemption of a long request then recomputes instead (counted as a swap fallback). None when
    it can."""
    if host_blocks * block_size >= max_model_len:
        return None
    need = cdiv(max_model_len, block_size)
    want = f", about {format_size(need * swap_space / host_blocks)}" if host_blocks else ""
    return (f"--swap-space {format_size(swap_space)} holds {host_blocks} KV blocks ({host_blocks * block_size} "
            f"tokens), less than one request of max_model_len {max_model_len} tokens ({need} blocks{want}): a "
            "preemption of a request longer than that recomputes instead of swapping (counted as a swap "
            "fallback); raise --swap-space to swap it")


def format_size(n: float) -> str:
    """``4 GiB``, ``96 KiB``, ``1.5 MiB``: a byte count for people."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_cpu_threads() -> int:
    """The CPU threads an engine uses unless told: ``TIDAL_CPU_THREADS`` when set (a share of the
    cores, e.g. for several processes side by side), else every core this process may run on."""
    share = env_str("TIDAL_CPU_THREADS")
    if share:
        try:
            if int(share) >= 1:
                return int(share)
        except ValueError:
            pass
        raise ConfigError(f"TIDAL_CPU_THREADS must be a positive integer, got {share!r}")
    return affinity_cores()


DEFAULT_START_WAIT_S = 600.0


def start_wait_s() -> float:
    """The longest a start waits for another process that does what every start needs once per
    machine (builds tidal's kernels, times the 4-bit matmuls): ``TIDAL_START_WAIT_S`` seconds when
    set, else 600. Past it the start goes on without (torch's kernels; its own timing)."""
    raw = (env_str("TIDAL_START_WAIT_S") or "").strip()
    if not raw:
        return DEFAULT_START_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise ConfigError(f"TIDAL_START_WAIT_S must be a number of seconds >= 0, got {raw!r}")
    return value


def affinity_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


__all__ = [
    "DEFAULT_CPU_KV_MEMORY", "CacheConfig", "ConfigError", "activation_reserve_bytes", "kv_pool_blocks", "EngineConfig", "ModelArch", "ModelConfig", "SchedulerConfig",
    "affinity_cores", "cdiv", "default_cpu_threads", "env_str", "parse_policy_args", "parse_size", "start_wait_s",
]
