"""Prefill/decode disaggregation in the simulator: what a hand-off costs, and its record.

The simulator (:mod:`tidal.sim.simulator`) moves a request from a prefill to a decode instance
the way the real runtime does (``tidal.runtime.cluster`` + ``tidal.runtime.worker``), with the
same pure objects: ``Dispatcher.choose_decode`` picks the target, ``tidal.cluster.handoff``
sizes the move and cuts it into chunks. This module prices those chunks on a link
(:mod:`tidal.sim.links`) and keeps one :class:`Handoff` record per request; ``summarize_handoffs``
gives their count, the pending ones and the distribution of their times. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tidal.cluster.handoff import DEFAULT_LAYERS_PER_CHUNK, DEFAULT_TOKENS_PER_CHUNK, ChunkSpec, plan_chunks
from tidal.config import ModelArch
from tidal.metrics import distribution
from tidal.sim.links import LinkSpec


@dataclass(frozen=True)
class HandoffConfig:
    """How KV moves between two instances: the link, the model's KV shape and the chunking."""

    link: LinkSpec
    num_layers: int
    kv_bytes_per_token_layer: int  # K and V of one token in one layer, all tensor-parallel shards
    tp: int = 1
    layers_per_chunk: int = DEFAULT_LAYERS_PER_CHUNK
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK

    def __post_init__(self) -> None:
        if self.layers_per_chunk < 0 or self.tokens_per_chunk < 0:
            raise ValueError("layers and tokens per chunk must be >= 0 (0: all in one chunk)")

    @classmethod
    def for_model(cls, arch: ModelArch, dtype_bytes: int, link: LinkSpec, tp: int = 1,
                  layers_per_chunk: int = DEFAULT_LAYERS_PER_CHUNK,
                  tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK) -> HandoffConfig:
        return cls(link, arch.num_layers, arch.kv_bytes_per_token(dtype_bytes, num_layers=1), tp,
                   layers_per_chunk, tokens_per_chunk)

    def chunks(self, num_tokens: int) -> list[ChunkSpec]:
        """The chunks of a request's first ``num_tokens`` tokens (the runtime's own plan)."""
        return plan_chunks(range(self.num_layers), 0, num_tokens, self.layers_per_chunk, self.tokens_per_chunk)

    def chunk_bytes(self, chunk: ChunkSpec) -> int:
        return len(chunk.layers) * chunk.num_tokens * self.kv_bytes_per_token_layer

    def cost(self, num_tokens: int, cached: int = 0) -> tuple[int, int, float]:
        """(chunks, bytes, seconds on the link) of moving ``num_tokens`` tokens' KV to an instance
        that holds the first ``cached`` of them (it reads only the chunks reaching past them); the
        chunks go one after the other, each paying the link's latency."""
        chunks = [c for c in self.chunks(num_tokens) if c.end > cached]
        sizes = [self.chunk_bytes(c) for c in chunks]
        return len(chunks), sum(sizes), sum(self.link.chunk_time(b, self.tp) for b in sizes)


@dataclass
class Handoff:
    """One request's move from its prefill instance ``src`` to a decode instance ``dst``."""

    request_id: str
    index: int  # the request's position in the workload
    src: int
    blocks: int  # KV blocks the decode instance must hold (tidal.cluster.handoff.handoff_blocks)
    num_tokens: int  # computed tokens whose KV moves
    num_chunks: int
    nbytes: int
    duration_s: float  # on the link, once it starts
    ready_s: float  # the prefill sampled the first token (the request paused there)
    dst: int | None = None
    chosen_s: float | None = None  # a decode instance took it (its blocks allocated there)
    start_s: float | None = None  # its first chunk on the link (after the hand-offs before it)
    end_s: float | None = None  # its last chunk lands: the decode instance resumes it
    landed: bool = False
    refusals: int = 0
    reused_tokens: int = 0  # of num_tokens, those the decode instance's prefix cache held (not sent)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ms(pairs: Sequence[tuple[float | None, float | None]]) -> dict[str, float | None]:
    return distribution([b - a for a, b in pairs if a is not None and b is not None], 1000.0)


def summarize_handoffs(handoffs: Sequence[Handoff], max_pending: int = 0) -> dict[str, Any]:
    """Counts and time distributions (ms): ``wait`` for a decode instance with room, ``link_queue``
    behind earlier hand-offs of the same prefill instance, ``transfer`` on the link, ``total``
    from the first token to the landing."""
    landed = [h for h in handoffs if h.landed]
    per_dst: dict[int, int] = {}
    for h in landed:
        assert h.dst is not None
        per_dst[h.dst] = per_dst.get(h.dst, 0) + 1
    return {
        "count": len(handoffs), "landed": len(landed),
        "pending_at_end": sum(h.dst is None for h in handoffs),
        "in_flight_at_end": sum(h.dst is not None and not h.landed for h in handoffs),
        "max_pending": max_pending, "refusals": sum(h.refusals for h in handoffs),
        "per_decode_instance": {str(k): v for k, v in sorted(per_dst.items())},
        "bytes_total": sum(h.nbytes for h in landed),
        "reused_tokens_total": sum(h.reused_tokens for h in landed),
        "bytes": distribution([h.nbytes for h in landed]),
        "chunks": distribution([h.num_chunks for h in landed]),
        "wait_ms": _ms([(h.ready_s, h.chosen_s) for h in handoffs]),
        "link_queue_ms": _ms([(h.chosen_s, h.start_s) for h in handoffs]),
        "transfer_ms": _ms([(h.start_s, h.end_s) for h in landed]),
        "total_ms": _ms([(h.ready_s, h.end_s) for h in landed]),
    }


__all__ = ["Handoff", "HandoffConfig", "summarize_handoffs"]
