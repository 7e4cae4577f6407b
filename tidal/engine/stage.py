"""A pipeline group of two engines after a KunServe drop: the head and its tail stage.

After a drop (KunServe Sec. 4.1) the *head* keeps the scheduler, the embedding, the first
decoder layers, the final norm, the LM head and sampling; the *tail* holds the remaining decoder
layers and their KV. The tail's KV pool is a mirror of the head's: the same number of blocks,
indexed by the head's block tables, so a step needs no block manager on the tail -- only the
chunks' positions and block tables (:func:`chunk_meta`) and the hidden states.

The runner talks to the tail through a :class:`StageLink`: ``send`` hands over a microbatch's
hidden states after the head's layers, ``recv`` returns them after the tail's. A step is split
into two cost-balanced microbatches (Sec. 4.3 / Fig. 11, :func:`split_microbatches`) so that,
across processes, the head computes microbatch 2 while the tail computes microbatch 1. In one
process (:class:`InProcessLink`) there is no overlap; only the order is the real one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tidal.cluster.pressure.lookahead import ChunkCost, Span, lookahead_microbatches
from tidal.config import ModelArch
from tidal.core.plan import ScheduledChunk
from tidal.core.sampling import SamplingParams

# (start, num_tokens, block table) of one chunk: all the tail needs to lay out attention
ChunkMeta = tuple[int, int, tuple[int, ...]]
_NO_SAMPLING = SamplingParams(max_tokens=1)


class StageLink(Protocol):
    """The runner's view of the next stage (the tail of the group)."""

    def send(self, step_id: int, index: int, h: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None: ...

    def recv(self, step_id: int, index: int) -> torch.Tensor: ...


def chunk_meta(chunks: Sequence[ScheduledChunk]) -> list[ChunkMeta]:
    return [(c.start, c.num_tokens, tuple(c.block_table)) for c in chunks]


def chunks_from_meta(meta: Sequence[ChunkMeta]) -> list[ScheduledChunk]:
    """Chunks the tail's batch builder accepts: positions and blocks are real, token ids are not
    (the tail gets hidden states, never tokens)."""
    return [ScheduledChunk(f"#{k}", (0,) * n, start, tuple(bt), False, _NO_SAMPLING)
            for k, (start, n, bt) in enumerate(meta)]


def eq1_flops(arch: ModelArch) -> ChunkCost:
    """Eq. 1's coefficients in FLOPs per layer (Sec. 4.3): alpha per attention pair (QK^T and PV),
    beta per token (the projections and the MLP), gamma 0. The split balances cost *ratios*, so a
    scale-free FLOP count serves until ``tidal profile``'s measured alpha, beta, gamma are given."""
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return ChunkCost(alpha=4.0 * q, beta=2.0 * (h * (2 * q + 2 * kv) + arch.mlp_matrices * h * arch.intermediate_size),
                     gamma=0.0)


def microbatch_cost(arch: ModelArch, profiled: Sequence[float] | None) -> tuple[ChunkCost, str]:
    """The Eq. 1 coefficients a head splits its steps with (Sec. 4.3), and where they come from:
    ``profiled`` (``tidal profile``'s alpha, beta, gamma, e.g. ``SchedulerConfig.microbatch_cost``)
    when given, else :func:`eq1_flops`."""
    if profiled is not None:
        return ChunkCost(*profiled), "profiled"
    return eq1_flops(arch), "FLOP ratios"


def split_microbatches(chunks: Sequence[ScheduledChunk], cost: ChunkCost, min_tokens: int,
                       num: int = 2) -> list[list[ScheduledChunk]]:
    """Sec. 4.3 / Fig. 11: at most ``num`` cost-balanced microbatches of a step's chunks (in
    order), cutting a prefill chunk where the balance needs it: the first part never samples, the
    second continues after it (its prefix is the first part's KV, written one microbatch earlier
    on every stage). Each microbatch lists its decodes first, as the batch layout expects."""
    by_id = {c.request_id: c for c in chunks}
    spans = [Span(c.request_id, c.start, c.num_tokens) for c in chunks]
    out = []
    for mb in lookahead_microbatches(spans, cost, min_tokens, max_microbatches=num):
        parts = []
        for s in mb:
            c = by_id[s.request_id]
            off = s.prefix - c.start
            last = s.prefix + s.tokens == c.context_len
            parts.append(c if (off == 0 and last) else dataclasses.replace(
                c, token_ids=c.token_ids[off:off + s.tokens], start=s.prefix, sample=c.sample and last))
        out.append([c for c in parts if c.is_decode] + [c for c in parts if not c.is_decode])
    return out


class TailStage:
    """An engine that is the tail of a group: runs its layers on the head's hidden states over its
    mirror KV pool (the head's block ids). It schedules nothing itself."""

    def __init__(self, engine: Any):
        if engine.has_unfinished_requests():
            raise ValueError("a tail stage holds no requests of its own (move them to the head first)")
        self.engine = engine

    @property
    def layer_ids(self) -> list[int]:
        return self.engine.model.layer_ids

    @torch.inference_mode()
    def forward(self, h: torch.Tensor, meta: Sequence[ChunkMeta]) -> torch.Tensor:
        e = self.engine
        _, batch = e.runner._build_batch(chunks_from_meta(meta))
        return e.model(h.to(e.device, e.dtype), batch, e.kv_cache.layers)

    def import_kv(self, block_table: Sequence[int], kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
                  start: int = 0) -> None:
        """Sec. 4.2's exchange, landing side: KV of the tail's layers at the head's block ids."""
        self.engine.kv_cache.import_(block_table, kv, start=start)

    def export_kv(self, block_table: Sequence[int], num_tokens: int,
                  start: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Sec. 4.4's exchange back: KV of the tail's layers for tokens ``[start, num_tokens)`` at
        the head's block ids."""
        return self.engine.kv_cache.export(block_table, None, start, num_tokens)


def restore_head(head: Any, tail_kv: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> int:
    """KunServe Sec. 4.4 on the head: reload the tail's layers (pool shrunk back, live blocks
    relocated), write each request's KV of those layers (``tail_kv``, by request, exported by the
    tail before the shrink: the copy is by token, so relocation does not matter), and run alone.
    Raises ValueError, changing nothing, when the blocks in use would not fit the smaller pool."""
    dropped = sorted(head.dropped_weight_bytes)
    n = head.restore_layers(dropped)
    for rid, kv in tail_kv.items():
        head.import_kv(rid, kv, 0)
    head.set_stage_link(None)
    return n


class InProcessLink:
    """A :class:`StageLink` to a :class:`TailStage` in this process (tests; no overlap)."""

    def __init__(self, tail: TailStage):
        self.tail = tail
        self._out: dict[tuple[int, int], torch.Tensor] = {}

    def send(self, step_id: int, index: int, h: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> None:
        self._out[(step_id, index)] = self.tail.forward(h, chunk_meta(chunks))

    def recv(self, step_id: int, index: int) -> torch.Tensor:
        return self._out.pop((step_id, index))


__all__ = ["ChunkMeta", "InProcessLink", "StageLink", "TailStage", "chunk_meta", "chunks_from_meta", "eq1_flops",
           "restore_head", "split_microbatches"]
