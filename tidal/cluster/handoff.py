"""What a prefill-to-decode hand-off moves, decided once for both shells (pure).

BucketServe Sec. III (P/D Scheduler): after the prefill, a request's KV goes to a decode
instance. The real runtime (``tidal.runtime.worker``) and the simulator (``tidal.sim``) plan
that move with the same two functions:

- :func:`handoff_blocks`: the KV blocks the decode instance must hold for the request: its
  computed tokens plus the slot of the token it decodes next;
- :func:`plan_chunks`: the chunks the KV travels in, layer groups outer and token ranges inner,
  so the sender keeps computing between chunks (the runtime writes them between its steps, for at
  most ``CHUNK_BUDGET_S`` per turn; the
  simulator charges each one latency plus bytes over bandwidth).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_LAYERS_PER_CHUNK = 8  # tidal.runtime.cluster.ClusterConfig's default too (a test checks)
DEFAULT_TOKENS_PER_CHUNK = 0  # 0: a chunk spans all of the request's tokens


@dataclass(frozen=True, slots=True)
class ChunkSpec:
    """Layers ``layers`` (layer ids) of tokens ``[start, end)``."""

    layers: tuple[int, ...]
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def plan_chunks(layers: Sequence[int], start: int, end: int, layers_per_chunk: int | None = None,
                tokens_per_chunk: int | None = None) -> list[ChunkSpec]:
    """Chunks covering ``layers`` x ``[start, end)``: layer groups outer, token ranges inner.

    ``layers_per_chunk`` / ``tokens_per_chunk`` of ``None`` (or 0) mean all of them in one chunk;
    the last group or range is shorter when the sizes do not divide evenly; no layers or no
    tokens give no chunks."""
    layers = list(layers)
    lpc = max(1, layers_per_chunk or len(layers))
    tpc = max(1, tokens_per_chunk or (end - start))
    out = []
    for i in range(0, len(layers), lpc):
        group = tuple(layers[i:i + lpc])
        for t in range(start, end, tpc):
            out.append(ChunkSpec(group, t, min(t + tpc, end)))
    return out


def handoff_blocks(num_computed_tokens: int, block_size: int) -> int:
    """KV blocks a decode instance needs for a handed-off request: ceil((computed + 1) / block_size)."""
    return -(-(num_computed_tokens + 1) // block_size)


__all__ = ["DEFAULT_LAYERS_PER_CHUNK", "DEFAULT_TOKENS_PER_CHUNK", "ChunkSpec", "handoff_blocks", "plan_chunks"]
