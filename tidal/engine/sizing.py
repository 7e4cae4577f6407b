"""Where an engine runs and how big its KV pool is: ``--device``, ``--dtype`` and the pool's block
count from the memory left after the weights (and, on CUDA, the activations and graphs)."""

from __future__ import annotations

import torch

from tidal.config import (
    DEFAULT_CPU_KV_MEMORY,
    ConfigError,
    EngineConfig,
    ModelArch,
    activation_reserve_bytes,
    kv_pool_blocks,
)
from tidal.engine.cuda_graph import graph_pool_bytes, padded_sizes


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was requested but no CUDA device is available")
    return dev


def resolve_dtype(name: str, device: torch.device, f32_weight_bytes: int | None = None) -> torch.dtype:
    """``--dtype`` on ``device``; ``auto``: bf16 (else fp16) on CUDA; on CPU the faster of bf16 and
    float32 where bf16 is native, timed once per machine (engine/dtype_pick.py; bf16 also when the
    model's float32 weights, ``f32_weight_bytes``, would take over half the memory), else float32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from tidal.engine.dtype_pick import cpu_auto_dtype

        return cpu_auto_dtype(f32_weight_bytes)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if dt is torch.float16 and device.type == "cpu":
        raise ConfigError("float16 is not supported on CPU; use bfloat16 or float32")
    return dt


def dtype_name(name: str, device: str = "auto", f32_weight_bytes: int | None = None) -> str:
    """What ``--dtype name`` is on ``device`` as the engine resolves it (``auto`` included), as a
    name: ``"bfloat16"``. Commands report this, never ``auto``."""
    return str(resolve_dtype(name, resolve_device(device), f32_weight_bytes)).removeprefix("torch.")


def num_kv_blocks(config: EngineConfig, device: torch.device, arch: ModelArch, block_bytes: int,
                  max_model_len: int, dtype: torch.dtype, graphs: bool = False) -> int:
    """The KV pool's blocks of ``block_bytes``: ``--num-blocks``, else ``--kv-cache-memory`` (CPU:
    its default), else on CUDA a fraction of the device's memory, less what is already used, less
    activations (and the decode graphs' pool when ``graphs``)."""
    cc = config.cache
    if cc.num_blocks_override:
        return cc.num_blocks_override
    if cc.kv_cache_memory is not None or device.type == "cpu":
        return kv_pool_blocks(block_bytes, kv_cache_memory=cc.kv_cache_memory or DEFAULT_CPU_KV_MEMORY)
    free, total = torch.cuda.mem_get_info(device)
    # blocks torch's caching allocator holds but no tensor uses (an engine built and dropped
    # earlier in this process) are this process's to reuse, not used memory
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    act = activation_reserve_bytes(arch, config.scheduler.max_num_batched_tokens)
    if graphs:  # the decode graphs' memory pool, beside the eager steps' activations
        n = config.scheduler.max_num_seqs
        act += graph_pool_bytes(padded_sizes(n)[-1], arch.hidden_size, arch.intermediate_size, arch.vocab_size,
                                arch.num_heads, arch.head_dim, max_model_len, dtype.itemsize)
    return kv_pool_blocks(block_bytes, total_bytes=total, utilization=cc.gpu_memory_utilization,
                          used_bytes=total - free - cached, activation_bytes=act)
