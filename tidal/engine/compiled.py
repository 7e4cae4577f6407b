"""``--compile``: steps of decodes run as ``torch.compile`` graphs (Inductor), from the embedding to
the logits: one graph for a lone decode (the latency-bound case), one for a batch of them (the
number of decodes dynamic). A step with a prefill, a pipeline stage (KunServe's head) or a model
whose layers were dropped runs eager.

On CPU a decode step is bound by per-op dispatch as much as by arithmetic (~750 small ops a step for
SmolLM2-135M). Fused, one decode ran 9.2-10 ms against 11-12.6 eager (float32, 2-core AVX2 EPYC),
and ``tidal bench offline`` workload (b) (batches of 32) gave 1.14x the eager engine's out tok/s. The
context width (the block-table width, at least 2 blocks so that a width of 1 never specializes a
graph) is dynamic; both graphs compile at start-up. Inductor rounds fused arithmetic once rather than
per op, so the logits differ from eager's in the last bits (float32: ~1e-3; more in bf16); a greedy
pick can move where two tokens nearly tie.

Shapes are static except that width and a batch's size (marked dynamic on each call). Dynamo checks
its guards before every call (among them that no two of the ~60 KV tensors and the inputs alias):
0.26 ms of a ~9.4 ms forward on a 2-core AVX2 EPYC in float32, median of 12 paired timings. A step
whose state matches one already run with the guards checked (the same graph and context width, the
same KV tensors of the same shapes,
the same layer modules, threads and grad mode: :meth:`CompiledDecode._state`) runs with guard
evaluation skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``); anything new goes
through the guards once (and recompiles if they fail), as a pool resize or a KunServe restore does.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tidal.common.progress import startup_phase
from tidal.core.plan import ScheduledChunk
from tidal.engine.attention import AttentionBatch, DecodeGroup
from tidal.engine.kv_cache import PagedKVCache
from tidal.engine.model import LlamaModel

MIN_WIDTH = 2  # blocks: widths 0 and 1 would specialize graphs of their own


class CompiledDecode:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache):
        self.model, self.kv = model, kv_cache
        self.block_size = kv_cache.block_size
        self.layer_ids = tuple(model.layer_ids)  # the model it was compiled for
        # static shapes except the context width and a batch's size (marked on each call): with
        # dynamic=True every tensor the graph reads (the 4-bit weights' too) got symbolic sizes, guards
        # and per-call size checks, and duck sizing tied a weight dimension of 2 to the warm-up's width
        # of 2 (a recompile)
        self.fn = torch.compile(self._forward, dynamic=False, fullgraph=True, options={"size_asserts": False})
        self.calls = 0  # steps it ran
        self.batches = 0  # of which steps of several decodes
        self.state: tuple = ()  # the state of the last step (_state)
        self.checked: set[tuple[int, int]] = set()  # (graph: 1 or 2+ decodes, width) whose steps passed the guards
        self.unguarded = 0  # steps run with guard evaluation skipped

    def _state(self) -> tuple:
        """What Dynamo's guards depend on besides the graph, the context width and the facts every call
        shares by construction (int64 ids, positions, slots and tables; a mask of width * block_size):
        the layer modules (a KunServe restore builds new ones), threads, grad mode and every KV tensor
        (a resize makes new ones)."""
        return (tuple((k, id(m)) for k, m in self.model.layers.items()), torch.get_num_threads(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(),
                tuple((id(kv.k), id(kv.v), tuple(kv.k.shape), kv.k.dtype) for kv in self.kv.layers.values()))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        batch = AttentionBatch(positions=positions, slot_mapping=slots, num_decodes=n,
                               decode_groups=[DecodeGroup(0, n, tables, mask)], prefills=[], block_size=self.block_size)
        return self.model.compute_logits(self.model(self.model.embed(ids), batch, self.kv.layers))

    def takes(self, chunks: list[ScheduledChunk], batch: AttentionBatch) -> bool:
        """Whether this step is sampled decodes only, in one decode group (one padded width), on the
        model as compiled."""
        return (len(batch.decode_groups) == 1 and all(c.is_decode and c.sample for c in chunks)
                and tuple(self.model.layer_ids) == self.layer_ids)

    def logits(self, input_ids: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        (g,) = batch.decode_groups
        tables, mask = g.block_tables, g.mask
        if tables.shape[1] < MIN_WIDTH:  # padded with block 0, masked out
            pad = MIN_WIDTH - tables.shape[1]
            tables = F.pad(tables, (0, pad))
            mask = F.pad(mask, (0, pad * self.block_size), value=False)
        self.calls += 1
        self.batches += input_ids.shape[0] > 1
        args = (input_ids, batch.positions, batch.slot_mapping, tables, mask)
        state, shape = self._state(), (min(input_ids.shape[0], 2), tables.shape[1])  # (one or a batch, width)
        if state != self.state:
            self.state, self.checked = state, set()
        if shape in self.checked:
            self.unguarded += 1
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self._call(*args)
        out = self._call(*args)
        self.checked.add(shape)
        return out

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(tables, 1)  # the context width
        torch._dynamo.mark_dynamic(mask, 3)
        if ids.shape[0] > 1:  # a batch: the number of decodes too (one decode has a graph of its own)
            for t in (ids, positions, slots, tables, mask):
                torch._dynamo.mark_dynamic(t, 0)
        return self.fn(ids, positions, slots, tables, mask)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile now, both graphs (one decode, and a batch: decodes at positions 0 of block 0, before
        any request holds a block), with a line before and after on stderr; returns the seconds it took."""
        t0 = time.perf_counter()
        dev = self.kv.device
        with startup_phase("compiling the decode steps (torch.compile; once, may take a minute)", "compiled"):
            self._warm_up(dev)
        return time.perf_counter() - t0

    def _warm_up(self, dev: torch.device) -> None:
        try:
            for n in (1, 2):
                # ids, positions and slots are three tensors: one passed three times would compile a
                # graph for inputs that alias (a recompile at the first step)
                ids, positions, slots = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(3))
                tables = torch.zeros(n, MIN_WIDTH, dtype=torch.long, device=dev)
                mask = torch.zeros(n, 1, 1, MIN_WIDTH * self.block_size, dtype=torch.bool, device=dev)
                mask[..., 0] = True
                self._call(ids, positions, slots, tables, mask)
        except Exception as e:  # noqa: BLE001 - Inductor's errors are many; the start-up names the cause
            first = " ".join(str(e).split())[:300] or type(e).__name__
            raise RuntimeError(f"--compile: torch.compile failed ({first}); on CPU Inductor needs a C++ "
                               "compiler (g++); run without --compile") from e
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
