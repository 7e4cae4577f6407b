"""Model runner: executes one StepPlan on the real model and returns a StepResult.

This is the real shell's counterpart of the simulator's cost-model executor. It applies the
plan's block copies (swap out, swap in), lays the scheduled tokens out as one flat batch
(decodes first, then prefill chunks), runs the model once, and samples where the plan says so.

Padding (a plan with ``composition.num_padded_tokens``, from ``static.pad``): the step is a
rectangle, every row as long as the longest chunk (:func:`tidal.core.plan.rectangle_padding`).
The padded tokens are really computed, as a second batch through every layer and the LM head
(the rows of finished members sample, as a static batch's rows do), and their results are
thrown away: each real chunk's pad tail, at the positions after it, and each dead row, at the
longest prefix. They write their K/V to a one-block scratch cache and attend only over
themselves (causally), so the real tokens, their KV and their samples are exactly those of the
unpadded run; what is not computed is a pad token's attention over the real context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from tidal.cluster.pressure.lookahead import ChunkCost
from tidal.core.plan import ScheduledChunk, StepPlan, StepResult
from tidal.engine.attention import AttentionBatch, DecodeGroup, KVLayer, PrefillSeq
from tidal.engine.compiled import CompiledDecode
from tidal.engine.cuda_graph import GraphedDecode
from tidal.engine.kv_cache import PagedKVCache
from tidal.engine.model import LlamaModel
from tidal.engine.sampler import Sampler, logprob_parts, token_logprobs
from tidal.engine.stage import StageLink, split_microbatches


@dataclass
class InFlight:
    """A decode step launched on the device whose samples the host has not read yet (--async-scheduling)."""

    plan: StepPlan
    rows: list[ScheduledChunk]  # the step's rows, in order
    tokens: torch.Tensor  # [rows]: the samples, on the device
    host: torch.Tensor  # their copy on the host (pinned on CUDA), whole once ``done`` has fired
    began: Any  # (:func:`_mark`) before the step's first copy
    done: Any  # after the samples' copy
    # rows asking for logprobs: every row's chosen token's log-probability and top (values, ids), on the host
    logprobs: list[torch.Tensor] | None = None


def _mark(device: torch.device) -> Any:
    """A point in a step: a CUDA event recorded on the current stream, or (CPU, where a step runs as it is
    launched) the ``perf_counter``."""
    if device.type != "cuda":
        return time.perf_counter()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, seed: int = 0):
        self.model = model
        self.kv = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.sampler = Sampler(seed)
        self.keep_logits = False  # tests: keep the last step's logits per request
        self.last_logits: dict[str, torch.Tensor] = {}
        # KunServe: the head of a pipeline group hands its hidden states to the tail's layers
        self.link: StageLink | None = None
        self.mb_cost: ChunkCost | None = None  # Eq. 1 coefficients for the microbatch split
        self.mb_min_tokens = 1  # Fig. 11's MIN: a step of this many tokens or fewer stays whole
        self.padded_tokens_computed = 0  # padding run through the model so far
        self._scratch: dict[int, KVLayer] | None = None
        self.compiled: CompiledDecode | None = None  # --compile (set by the engine)
        self.graphs: GraphedDecode | None = None  # CUDA graphs of decode steps (set by the engine)
        self._sample_staging: list[torch.Tensor] = []  # two pinned buffers of sampled ids, taken in turn
        self._sample_turn = 0

    # ------------------------------------------------------------------ batch layout
    def _build_batch(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, AttentionBatch]:
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decodes = [c for c in chunks if c.is_decode]  # already longest context first
        prefills = [c for c in chunks if not c.is_decode]
        for c in decodes:
            p = c.start
            ids.append(c.token_ids[0])
            positions.append(p)
            slots.append(c.block_table[p // bs] * bs + p % bs)
        pre_seqs: list[PrefillSeq] = []
        for c in prefills:
            offset = len(ids)
            ids.extend(c.token_ids)
            pos = range(c.start, c.start + c.num_tokens)
            positions.extend(pos)
            bt = c.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in pos)
            nblk = -(-c.context_len // bs)
            table = torch.tensor(bt[:nblk], dtype=torch.long, device=dev)
            mask = None
            if c.start > 0 and not self.model.triton_attention:  # a cached prefix: query i sees keys [0, start + i]
                q_pos = torch.arange(c.start, c.context_len, device=dev).unsqueeze(1)
                mask = torch.arange(c.context_len, device=dev).unsqueeze(0) <= q_pos
            pre_seqs.append(PrefillSeq(offset, c.num_tokens, c.start, table, mask))
        groups = [self._decode_group(decodes[a:b], a) for a, b in self._group_bounds(decodes)]
        batch = AttentionBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes), decode_groups=groups,
            prefills=pre_seqs, block_size=bs)
        if self.model.triton_attention and prefills:  # one varlen call a layer for every chunk
            from tidal.engine.triton_attention import varlen_meta

            batch.varlen = varlen_meta([(p.offset, c.num_tokens, c.start, c.block_table[:-(-c.context_len // bs)])
                                        for p, c in zip(pre_seqs, prefills, strict=True)], dev)
        return torch.tensor(ids, dtype=torch.long, device=dev), batch

    def _group_bounds(self, decodes: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """Split decodes (sorted by context, longest first) where padding to the group's longest
        context would waste more than a third of the gathered KV. tidal's paged attention kernel
        gathers nothing (each decode reads its own blocks, however long): one group."""
        if self.model.native_attention or self.model.triton_attention:
            return [(0, len(decodes))] if decodes else []
        bounds, start = [], 0
        for i in range(1, len(decodes) + 1):
            last = i == len(decodes)
            if last or (decodes[i].context_len < self.GROUP_FILL * decodes[start].context_len
                        and i - start >= self.MIN_GROUP):
                bounds.append((start, i))
                start = i
        return bounds

    GROUP_FILL = 0.67  # a decode joins the group while its context is >= this share of the longest
    MIN_GROUP = 4  # fewer decodes than this are not worth a separate attention call

    def _decode_group(self, decodes: list[ScheduledChunk], offset: int) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        width = max(-(-c.context_len // bs) for c in decodes)
        rows = [list(c.block_table[:width]) + [0] * (width - min(width, len(c.block_table))) for c in decodes]
        if self.model.triton_attention:  # the kernel reads each decode's own length: no mask
            return DecodeGroup(offset, len(decodes), torch.tensor(rows, dtype=torch.int32, device=dev), None,
                               torch.tensor([c.context_len for c in decodes], dtype=torch.int32, device=dev))
        ctx = torch.tensor([c.context_len for c in decodes], device=dev)
        mask = (torch.arange(width * bs, device=dev).unsqueeze(0) < ctx.unsqueeze(1)).view(
            len(decodes), 1, 1, width * bs)
        return DecodeGroup(offset, len(decodes), torch.tensor(rows, dtype=torch.long, device=dev), mask)

    # ------------------------------------------------------------------ padding
    def _run_padding(self, chunks: list[ScheduledChunk], num_padded: int) -> None:
        """Compute the step's padded tokens (see the module docstring) and drop the results."""
        longest = max(c.num_tokens for c in chunks)
        prefix = max(c.start for c in chunks)
        dead = (sum(c.num_tokens for c in chunks) + num_padded) // longest - len(chunks)
        segs = [(c.context_len, longest - c.num_tokens) for c in chunks if c.num_tokens < longest]
        segs += [(prefix, longest)] * max(dead, 0)
        if not segs:
            return
        dev, bs = self.device, self.block_size
        if self._scratch is None:
            k = self.kv.layers[next(iter(self.kv.layers))].k
            shape = (1, *k.shape[1:])
            self._scratch = {i: KVLayer(torch.zeros(shape, dtype=k.dtype, device=dev),
                                        torch.zeros(shape, dtype=k.dtype, device=dev)) for i in self.kv.layers}
        positions: list[int] = []
        pre: list[PrefillSeq] = []
        for start, n in segs:
            pre.append(PrefillSeq(len(positions), n, start, torch.zeros(1, dtype=torch.long, device=dev), None))
            positions.extend(range(start, start + n))
        batch = AttentionBatch(positions=torch.tensor(positions, dtype=torch.long, device=dev),
                               slot_mapping=torch.tensor([p % bs for p in positions], dtype=torch.long, device=dev),
                               num_decodes=0, decode_groups=[], prefills=pre, block_size=bs)
        h = self.model(self.model.embed(torch.zeros(len(positions), dtype=torch.long, device=dev)), batch,
                       self._scratch)
        if dead > 0:  # the dead rows sample too, as every row of a static batch does
            self.model.compute_logits(h[torch.tensor([p.offset + p.num_tokens - 1 for p in pre[-dead:]], device=dev)])
        self.padded_tokens_computed += len(positions)

    # ------------------------------------------------------------------ step
    @staticmethod
    def _sample_rows(chunks: list[ScheduledChunk]) -> tuple[list[int], list[ScheduledChunk]]:
        """Logits only where a token is sampled: the last token of each finishing chunk."""
        rows, sampling = [], []
        offset = 0
        for c in chunks:
            offset += c.num_tokens
            if c.sample:
                rows.append(offset - 1)
                sampling.append(c)
        return rows, sampling

    def _execute_pipelined(self, step_id: int, ordered: list[ScheduledChunk]
                           ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Head of a group: each microbatch runs the head's layers and goes to the tail (Sec. 4.3's
        lookahead microbatches, Fig. 11: the head computes the second while the tail computes the
        first); then the rows to sample come back, in microbatch order."""
        mbs = split_microbatches(ordered, self.mb_cost, self.mb_min_tokens) if self.mb_cost else [ordered]
        for k, mb in enumerate(mbs):
            input_ids, batch = self._build_batch(mb)
            self.link.send(step_id, k, self.model(self.model.embed(input_ids), batch, self.kv.layers), mb)
        hs, sampling = [], []
        for k, mb in enumerate(mbs):
            h = self.link.recv(step_id, k)
            rows, s = self._sample_rows(mb)
            if rows:
                hs.append(h[torch.tensor(rows, device=self.device)])
                sampling += s
        return (torch.cat(hs) if hs else torch.empty(0)), sampling

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self.sampler.forget(plan.finished)
        self.kv.swap_out(plan.swap_out)
        self.kv.swap_in(plan.swap_in)
        result = StepResult(step_id=plan.step_id, composition=plan.composition)
        if plan.is_empty:
            result.step_time_s = time.perf_counter() - t0
            return result
        # decodes first, longest context first (groups of similar length pad little), then prefills
        ordered = (sorted((c for c in plan.chunks if c.is_decode), key=lambda c: -c.context_len)
                   + [c for c in plan.chunks if not c.is_decode])
        if plan.composition.num_padded_tokens and self.link is None:  # (a pipeline group never pads)
            self._run_padding(ordered, plan.composition.num_padded_tokens)
        logits = None
        if self.link is None and self.graphs is not None and self.graphs.takes(ordered):
            logits = self.graphs.logits(ordered)
            sampling = ordered
        elif self.link is None:
            input_ids, batch = self._build_batch(ordered)
            if self.compiled is not None and self.compiled.takes(ordered, batch):
                logits = self.compiled.logits(input_ids, batch)
                sampling = ordered
            else:
                h = self.model(self.model.embed(input_ids), batch, self.kv.layers)
                rows, sampling = self._sample_rows(ordered)
                h = h[torch.tensor(rows, device=self.device)] if rows else h
        else:
            h, sampling = self._execute_pipelined(plan.step_id, ordered)
        if sampling:
            # every row greedy: the argmax alone, where the head fuses it (None where it does not)
            fused = self.model.greedy_tokens(h) if logits is None and not self.keep_logits and all(
                c.sampling.greedy and c.sampling.logprobs is None for c in sampling) else None
            if fused is not None:
                tokens, lps = fused.tolist(), [None] * len(sampling)
            else:
                if logits is None:
                    logits = self.model.compute_logits(h)
                if self.keep_logits:
                    self.last_logits = {c.request_id: logits[i].cpu() for i, c in enumerate(sampling)}
                tokens, lps = self.sampler.sample(
                    logits, [c.request_id for c in sampling], [c.sampling for c in sampling])
            for c, tok, lp in zip(sampling, tokens, lps, strict=True):
                result.sampled[c.request_id] = tok
                if lp is not None:
                    result.logprobs[c.request_id] = lp
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.step_time_s = time.perf_counter() - t0
        return result

    # ------------------------------------------------------------------ steps run ahead of the host
    def overlap_ready(self) -> bool:
        """Whether a decode step can run ahead of the host (--async-scheduling): the graphs' static step
        (CUDA graphs, or in tests their CPU twin) on the model as built, no pipeline link, no compile, no
        logits kept."""
        g = self.graphs
        return (g is not None and self.link is None and self.compiled is None and not self.keep_logits
                and tuple(self.model.layer_ids) == g.layer_ids)

    def can_overlap(self, plan: StepPlan) -> bool:
        """Whether ``plan`` can be launched and its samples read later: sampled decodes the graphs take (the
        samples and any logprobs are drawn on the device), no copies and no padding."""
        return (self.overlap_ready() and not plan.is_empty and not plan.swap_out and not plan.swap_in
                and not plan.composition.num_padded_tokens and self.graphs.takes(list(plan.chunks)))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, after: InFlight | None = None) -> InFlight:
        """Queue ``plan`` (:meth:`can_overlap`) on the device and return at once; :meth:`collect` reads its
        samples. ``after``: the step before, still in flight, whose samples are this plan's tokens
        (:data:`~tidal.core.plan.PENDING_TOKEN`), taken on the device. The rows are ordered as
        :meth:`execute` orders decodes, longest context first."""
        self.sampler.forget(plan.finished)
        rows = sorted(plan.chunks, key=lambda c: -c.context_len)
        feed = None
        if after is not None:
            at = {c.request_id: i for i, c in enumerate(after.rows)}
            feed = (after.tokens, [at[c.request_id] for c in rows])
        if not self._sample_staging:
            n, pin = self.graphs.sizes[-1], self.device.type == "cuda"
            self._sample_staging = [torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        began = _mark(self.device)
        logits = self.graphs.logits(rows, feed)
        tokens = self.sampler.draw(logits, [c.request_id for c in rows], [c.sampling for c in rows])
        host = self._sample_staging[self._sample_turn][:len(rows)]  # (the step before still reads the other)
        self._sample_turn ^= 1
        host.copy_(tokens, non_blocking=True)
        lps = self._logprobs(logits, tokens, rows)
        return InFlight(plan, rows, tokens, host, began, _mark(self.device), lps)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[ScheduledChunk]
                  ) -> list[torch.Tensor] | None:
        """Sampler.sample's logprobs (:func:`~tidal.engine.sampler.logprob_parts`), for every row at once when
        any asks, k the largest asked, copied to the host behind the step's samples."""
        ks = [c.sampling.logprobs for c in rows if c.sampling.logprobs is not None]
        if not ks:
            return None
        parts = logprob_parts(logits, tokens, max(ks))
        pin = self.device.type == "cuda"
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in parts]
        for dst, t in zip(out, parts, strict=True):
            dst.copy_(t, non_blocking=True)
        return out

    def collect(self, step: InFlight) -> StepResult:
        """Wait for a launched step's samples (only for that step: the one queued after it runs on) and
        return its result; its time is the device's, from its first copy to its samples' copy."""
        if isinstance(step.done, float):
            seconds = step.done - step.began
        else:
            step.done.synchronize()
            seconds = step.began.elapsed_time(step.done) / 1e3
        result = StepResult(step_id=step.plan.step_id, composition=step.plan.composition, step_time_s=seconds)
        tokens = step.host.tolist()
        result.sampled = dict(zip((c.request_id for c in step.rows), tokens, strict=True))
        if step.logprobs is not None:
            parts = [t.tolist() for t in step.logprobs]
            for j, c in enumerate(step.rows):
                if c.sampling.logprobs is not None:
                    result.logprobs[c.request_id] = token_logprobs(tokens[j], c.sampling.logprobs, j, parts)
        return result
