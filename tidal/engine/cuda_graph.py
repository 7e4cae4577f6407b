"""Decode steps as CUDA graphs: captured once per padded batch size, replayed every step.

Why: a decode step of a Llama model is ~700 small kernel launches (norms, RoPE, matmuls, attention per
layer); on a GPU the host cannot issue them as fast as the GPU runs them, so an eager step of an 8B
model took ~3x the time its kernels take. A graph replays all of them with one launch.

How: the step runs on static buffers — token ids, positions, slots, block tables padded to the longest
context the engine allows (``max_model_len``) — for a batch padded up to the next captured size
(:data:`SIZES`). Padded rows are real rows of the graph that write their K/V to a scratch block past
the pool (``PagedKVCache(scratch_block=True)``) and attend only over it, so they never touch a
request's blocks; their logits are dropped. Attention walks each decode's own context (the Triton
kernel's split count depends only on the padded width), so a graph captured at start-up serves every
context length. Graphs share one memory pool and are captured largest first.

A step with a prefill runs eagerly; so does a decode batch larger than ``max_num_seqs`` (never planned)
and a step after the model's layers or KV tensors changed (KunServe's drop / restore, a pool resize)
until the graphs are captured again for the new tensors (on demand, one size at a time).

On CPU there are no graphs: the same padded static step runs eagerly (``capture=False``), which is how
CI checks that it gives the same tokens as the dynamic step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tidal.common.progress import startup_line, startup_phase
from tidal.core.plan import ScheduledChunk
from tidal.engine.attention import AttentionBatch, DecodeGroup, num_splits
from tidal.engine.kv_cache import PagedKVCache
from tidal.engine.model import LlamaModel

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # then steps of 64


def padded_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured for ``max_num_seqs``: :data:`SIZES` up to it, then steps of 64, the last
    one at least ``max_num_seqs``."""
    out = [s for s in SIZES if s < max_num_seqs]
    top = out[-1] if out else 0
    nxt = next((s for s in SIZES if s >= max_num_seqs), None)
    if nxt is None:
        nxt = top + 64 * -(-(max_num_seqs - top) // 64)
    return [*out, nxt]


def pad_to(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``n`` decodes, or None."""
    return next((s for s in sizes if s >= n), None)


def graph_pool_bytes(num_seqs: int, hidden: int, intermediate: int, vocab: int, heads: int, head_dim: int,
                     width_tokens: int, dtype_bytes: int) -> int:
    """An upper estimate of the graphs' memory pool (the largest graph's activations: its tensors are
    shared by every smaller one): a layer's activations (the residual, the QKV, MLP and attention
    rows), the attention's split partials in float32, and the float32 logits."""
    per_row = (4 * hidden + 3 * intermediate + 4 * heads * head_dim) * dtype_bytes + vocab * 4
    splits = num_splits(width_tokens)
    return num_seqs * (per_row + heads * splits * (head_dim + 1) * 4) + (8 << 20)


class _Staging:
    """One set of host buffers a step's inputs are written to and copied from (pinned on CUDA)."""

    def __init__(self, n: int, width: int, table_dtype: torch.dtype, pin: bool):
        # ids, positions, slots, block tables, and a fed step's rows of the step before
        shapes = ((n,), (n,), (n,), (n, width), (n,))
        dtypes = (torch.long, torch.long, torch.long, table_dtype, torch.long)
        self.tensors = tuple(torch.zeros(s, dtype=d, pin_memory=pin) for s, d in zip(shapes, dtypes, strict=True))
        self.arrays = tuple(t.numpy() for t in self.tensors)


class GraphedDecode:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_num_seqs: int, max_model_len: int,
                 capture: bool):
        self.model, self.kv = model, kv_cache
        self.bs = kv_cache.block_size
        self.sizes = padded_sizes(max_num_seqs)
        self.width = -(-max_model_len // self.bs)  # blocks: a table holds the longest context allowed
        self.capture = capture
        self.device = kv_cache.device
        n, dev = self.sizes[-1], self.device
        ttype = torch.int32 if model.triton_attention else torch.long
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, self.width, dtype=ttype, device=dev)
        self.feed_rows = torch.zeros(n, dtype=torch.long, device=dev)  # a fed step's rows of the step before
        # host staging, one copy of each buffer a step, in two sets taken in turn: a step planned while the
        # one before runs (--async-scheduling) fills one set while the other's copies may still be queued
        self.staging = [_Staging(n, self.width, ttype, pin=dev.type == "cuda") for _ in range(2)]
        self._turn = 0
        self.layer_ids = tuple(model.layer_ids)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # size -> (replay, its logits)
        self.pool = None
        self.state: tuple = self._state()
        self.replays = 0  # steps that ran a graph (or, on CPU, the static step)
        self.captures = 0  # graphs captured, recaptures included
        self.pool_bytes = 0  # memory the captures took (CUDA)

    def _state(self) -> tuple:
        """What a captured graph has baked in besides its inputs: the layer modules and every KV tensor."""
        return (tuple((k, id(m)) for k, m in self.model.layers.items()),
                tuple((id(kv.k), id(kv.v)) for kv in self.kv.layers.values()))

    def takes(self, chunks: list[ScheduledChunk]) -> bool:
        """Sampled decodes only, no more than the largest size, on the model as built."""
        return (0 < len(chunks) <= self.sizes[-1] and all(c.is_decode and c.sample for c in chunks)
                and tuple(self.model.layer_ids) == self.layer_ids)

    # ------------------------------------------------------------------ the static step
    def _forward(self, n: int) -> torch.Tensor:
        """The decode step on the first ``n`` rows of the static buffers: their logits [n, vocab]."""
        positions, tables = self.positions[:n], self.tables[:n]
        lens = (positions + 1).to(torch.int32)
        mask = None
        if not (self.model.triton_attention or self.model.native_attention):  # torch's path masks the width
            mask = (torch.arange(self.width * self.bs, device=self.device).unsqueeze(0) < lens.unsqueeze(1)).view(
                n, 1, 1, self.width * self.bs)
        batch = AttentionBatch(positions=positions, slot_mapping=self.slots[:n], num_decodes=n,
                               decode_groups=[DecodeGroup(0, n, tables, mask, lens)], prefills=[], block_size=self.bs)
        return self.model.compute_logits(self.model(self.model.embed(self.ids[:n]), batch, self.kv.layers))

    def _fill(self, chunks: list[ScheduledChunk], n: int, feed: tuple[torch.Tensor, list[int]] | None) -> None:
        """Copy this step's decodes into the static buffers; rows past them are padding (the scratch block).
        The host side writes through numpy views (a tensor element write costs microseconds a row).
        ``feed``: the token ids are on the device, row ``i``'s at ``feed[0][feed[1][i]]``."""
        bs, scratch, k = self.bs, self.kv.scratch_block, len(chunks)
        stage = self.staging[self._turn]
        self._turn ^= 1
        ids, pos, slots, tables, rows = stage.arrays
        starts = [c.start for c in chunks]
        ids[:k] = 0 if feed is not None else [c.token_ids[0] for c in chunks]
        pos[:k] = starts
        slots[:k] = [c.block_table[p // bs] * bs + p % bs for c, p in zip(chunks, starts, strict=True)]
        used = max(starts) // bs + 1
        for i, c in enumerate(chunks):
            nb = starts[i] // bs + 1
            tables[i, :nb] = c.block_table[:nb]
        if k < n:
            ids[k:n] = 0
            pos[k:n] = 0
            slots[k:n] = scratch * bs
            tables[k:n, 0] = scratch
        h_ids, h_pos, h_slots, h_tables, h_rows = stage.tensors
        self.ids[:n].copy_(h_ids[:n], non_blocking=True)
        self.positions[:n].copy_(h_pos[:n], non_blocking=True)
        self.slots[:n].copy_(h_slots[:n], non_blocking=True)
        self.tables[:n, :used].copy_(h_tables[:n, :used], non_blocking=True)
        if feed is not None:  # the ids the step before sampled, gathered on the device (no host round trip)
            tokens, src = feed
            rows[:k] = src
            self.feed_rows[:k].copy_(h_rows[:k], non_blocking=True)
            torch.index_select(tokens, 0, self.feed_rows[:k], out=self.ids[:k])

    @torch.inference_mode()
    def logits(self, chunks: list[ScheduledChunk], feed: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """This step's logits [len(chunks), vocab], from the graph of its padded size. ``feed``: the
        rows' token ids are not known on the host yet (``(tokens, rows)``: row ``i`` takes
        ``tokens[rows[i]]``, a sample still on the device)."""
        n = pad_to(len(chunks), self.sizes)
        state = self._state()
        if state != self.state:  # new layers or KV tensors: the graphs point at the old ones
            self.state, self.graphs = state, {}
        if self.capture and n not in self.graphs:
            self._capture(n)  # on padding rows, so before this step's inputs are written
        self._fill(chunks, n, feed)
        self.replays += 1
        if not self.capture:
            return self._forward(n)[:len(chunks)]
        replay, out = self.graphs[n]
        replay()
        return out[:len(chunks)]

    # ------------------------------------------------------------------ capture
    def _pad_all(self, n: int) -> None:
        scratch = self.kv.scratch_block
        self.ids[:n] = 0
        self.positions[:n] = 0
        self.slots[:n] = scratch * self.bs
        self.tables[:n, 0] = scratch

    def _capture(self, n: int) -> None:
        self._pad_all(n)  # capture on padding rows only: no request's KV is written
        self._forward(n)  # compiles the Triton kernels and settles the allocator, outside the capture
        self.graphs[n] = self._record(n)
        self.captures += 1

    def _record(self, n: int) -> tuple[Callable[[], None], torch.Tensor]:
        """The decode step on the first ``n`` rows captured as a CUDA graph in the shared pool: its replay
        and the logits tensor each replay writes."""
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(n)
        return graph.replay, out

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every size now, largest first (the smaller ones reuse its pool), with a line before and
        after on stderr; returns the seconds it took."""
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        with startup_phase(f"capturing CUDA graphs of the decode step ({len(self.sizes)} batch sizes, "
                           f"{self.sizes[0]}..{self.sizes[-1]})", "CUDA graphs captured"):
            for n in reversed(self.sizes):
                self._capture(n)
            torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        startup_line(f"the CUDA graphs' memory pool: {self.pool_bytes / 2**20:.0f} MiB")
        return time.perf_counter() - t0
