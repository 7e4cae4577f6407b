"""LLMEngine: one instance of the real shell.

It owns the model, the paged KV tensors, the pure scheduler and block manager, and the output
side (incremental detokenization, stop strings, n > 1 fan-out). ``step()`` runs one scheduler
step on the model and returns the outputs that changed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.common.progress import startup_phase
from tidal.config import (
    DEFAULT_CPU_KV_MEMORY,
    ConfigError,
    EngineConfig,
    activation_reserve_bytes,
    default_cpu_threads,
    kv_pool_blocks,
)
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import RequestUpdate, StepPlan, StepResult
from tidal.core.request import FinishReason, Request, RequestClass
from tidal.core.sampling import SamplingParams
from tidal.core.scheduler import RequestRejected, Scheduler
from tidal.engine.cuda_graph import GraphedDecode, graph_pool_bytes, padded_sizes
from tidal.engine.kv_cache import PagedKVCache, kv_block_bytes
from tidal.engine.loader import LoadedCheckpoint, load_checkpoint
from tidal.engine.model import LlamaModel
from tidal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tidal.engine.quant import describe_quantization
from tidal.engine.runner import ModelRunner
from tidal.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tidal.policies import build_policy

log = logging.getLogger("tidal.engine")


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


@dataclass
class RequestSnapshot:
    """A request in flight, as plain data: what export_request gives and import_request takes."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    num_computed_tokens: int
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [tokens, kv_heads, head_dim]
    priority: int = 0
    request_class: str = "online"
    text_sent: int | None = None  # characters of output text the client already has (None: all of it)


@dataclass
class _Child:
    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # all text so far (after stop-string truncation)
    sent: int = 0  # characters already emitted
    tok_sent: int = 0  # token ids already emitted
    lp_sent: int = 0  # logprob entries already emitted
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[_Child]
    arrival_time: float


class LLMEngine:
    # CPU: decode steps run GraphedDecode's padded static step eagerly (no graphs on CPU): how the tests
    # check the step a CUDA graph captures; never set outside tests
    static_decode_on_cpu = False

    def __init__(self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config = config or EngineConfig()
        self.clock = clock  # the scheduler's "now"; a test can drive the engine on a virtual clock
        mc, cc, sc = config.model, config.cache, config.scheduler
        self.device = resolve_device(mc.device)
        if self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads or default_cpu_threads())
        torch.manual_seed(mc.seed)
        self.policy = build_policy(sc)  # a bad --batching / --policy-arg fails here, before the weights load
        self.checkpoint = ckpt = checkpoint or load_checkpoint(mc.model)
        self.arch = arch = ckpt.arch
        self.dtype = resolve_dtype(mc.dtype, self.device, 4 * arch.num_params())
        self.tokenizer = tokenizer or Tokenizer.from_checkpoint(ckpt)
        self.max_model_len = min(mc.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
        self.model = LlamaModel(arch, self.dtype, self.device, mc.layer_range, max_positions=self.max_model_len)
        if ckpt.format == "gguf" or mc.quantization == "none":
            why_not_int4 = self.model.set_quantization(mc.quantization, sc.max_num_batched_tokens, sc.max_num_seqs)
        else:  # no start-up timing: safetensors hold float weights, never 4-bit or Q8_0 groups
            why_not_int4 = self.model.set_quantization("none") or "the checkpoint's weights are float, not GGUF groups"
        dequantize = "" if ckpt.weights_cached() else ", dequantizing the GGUF (once per file)"
        with startup_phase(f"loading the weights of {os.path.basename(ckpt.path)}{dequantize}", "weights loaded"):
            self.model.load_weights(ckpt.weights())
        self.quantization = {**self.model.quantization_report(), "requested": mc.quantization,
                             **({"why_not": why_not_int4} if why_not_int4 else {})}
        layer_ids = self.model.layer_ids
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else resolve_dtype(cc.kv_cache_dtype, self.device)
        self.model.set_attention(mc.attention_backend, self.kv_dtype)
        # CUDA: decode steps replay CUDA graphs (engine/cuda_graph.py) unless --enforce-eager (or --compile); a
        # pipeline stage (a layer range) runs eager: its steps take and give hidden states
        graphs = ((self.device.type == "cuda" or self.static_decode_on_cpu) and not mc.enforce_eager and not mc.compile
                  and self.model.is_first and self.model.is_last)
        block_bytes = kv_block_bytes(arch, cc.block_size, self.kv_dtype, len(layer_ids))
        num_blocks = self._num_blocks(block_bytes, graphs)
        num_host = cc.swap_space // block_bytes if sc.preemption_mode == "swap" else 0
        self.kv_cache = PagedKVCache(arch, layer_ids, num_blocks, cc.block_size, self.kv_dtype, self.device, num_host,
                                     scratch_block=graphs)
        self.kv_manager = KVCacheManager(num_blocks, cc.block_size, num_host)
        self.scheduler = Scheduler(sc, self.kv_manager, self.policy, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, seed=mc.seed)
        if graphs:
            self.runner.graphs = GraphedDecode(self.model, self.kv_cache, sc.max_num_seqs, self.max_model_len,
                                               capture=self.device.type == "cuda")
            if self.runner.graphs.capture:
                self.runner.graphs.capture_all()
        if mc.compile:
            from tidal.engine.compiled import CompiledDecode

            self.runner.compiled = CompiledDecode(self.model, self.kv_cache)
            self.runner.compiled.warm_up()
        self.pool_spare_bytes = 0  # KV memory too small for one more block (after a drop / restore)
        self.dropped_weight_bytes: dict[int, int] = {}  # dropped layer -> its weights' bytes
        self.eos_token_ids = tuple(arch.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self._groups: dict[str, _Group] = {}
        self._child_parent: dict[str, tuple[str, int]] = {}
        self.last_result: StepResult | None = None
        self.last_plan: StepPlan | None = None
        self.num_steps = 0
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d; weights: %s",
                 ckpt.path, self.device, self.dtype, num_blocks, cc.block_size, self.max_model_len,
                 describe_quantization(self.quantization))

    def describe_weights(self) -> str:
        """What runs the model, as start-up prints it: ``"bfloat16, weights: int4 for ..."``."""
        compiled = "; decode steps compiled (--compile)" if self.runner.compiled is not None else ""
        compiled += "; decode steps as CUDA graphs" if self.cuda_graphs else ""
        attention = {"tidal-cpu": "; decode attention: tidal's paged kernel",
                     "triton": "; attention: Triton paged kernels"}.get(self.model.attention_backend, "")
        kv = f"; KV cache {str(self.kv_dtype).removeprefix('torch.')}" if self.kv_dtype != self.dtype else ""
        return (f"{str(self.dtype).removeprefix('torch.')}, weights: {describe_quantization(self.quantization)}"
                f"{attention}{kv}{compiled}")

    @property
    def attention_backend(self) -> str:
        """What attends: ``triton``, ``tidal-cpu`` (tidal's C++ kernels) or ``torch``."""
        return self.model.attention_backend

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self.runner.graphs is not None and self.runner.graphs.capture

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _num_blocks(self, block_bytes: int, graphs: bool = False) -> int:
        cc = self.config.cache
        if cc.num_blocks_override:
            return cc.num_blocks_override
        if cc.kv_cache_memory is not None or self.device.type == "cpu":
            return kv_pool_blocks(block_bytes, kv_cache_memory=cc.kv_cache_memory or DEFAULT_CPU_KV_MEMORY)
        # CUDA: a fraction of the device's memory, less what is already used, less activations
        free, total = torch.cuda.mem_get_info(self.device)
        # blocks torch's caching allocator holds but no tensor uses (an engine built and dropped
        # earlier in this process) are this process's to reuse, not used memory
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        act = activation_reserve_bytes(self.arch, self.config.scheduler.max_num_batched_tokens)
        if graphs:  # the decode graphs' memory pool, beside the eager steps' activations
            a, n = self.arch, self.config.scheduler.max_num_seqs
            act += graph_pool_bytes(padded_sizes(n)[-1], a.hidden_size, a.intermediate_size, a.vocab_size,
                                    a.num_heads, a.head_dim, self.max_model_len, self.dtype.itemsize)
        return kv_pool_blocks(block_bytes, total_bytes=total, utilization=cc.gpu_memory_utilization,
                              used_bytes=total - free - cached, activation_bytes=act)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    request_class: str | RequestClass = RequestClass.ONLINE, pause_at: int | None = None) -> None:
        """Queue a request. ``pause_at`` (n=1 only) makes it DynaServe's alpha micro-request: it
        pauses, holding its KV, once that many tokens have KV (``scheduler.drain_reached_pause``)."""
        params = params or SamplingParams()
        if pause_at is not None and (params.n != 1 or pause_at < 1):
            raise ValueError("pause_at needs n=1 and a split point >= 1")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if request_id in self._groups:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt_token_ids)} tokens and max_tokens is {params.max_tokens}", param="max_tokens")
        arrival = self.clock() if arrival_time is None else arrival_time
        group = _Group(request_id, text, list(prompt_token_ids), params, [], arrival)
        reqs = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            reqs.append(Request(child_id, list(prompt_token_ids), child_params, arrival_time=arrival,
                                eos_token_ids=self.eos_token_ids, priority=priority,
                                request_class=RequestClass(request_class), pause_at=pause_at))
        added: list[str] = []
        try:
            for req in reqs:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except RequestRejected:
            self.scheduler.abort_requests(added)  # all children or none
            raise
        for i, req in enumerate(reqs):
            child_id = req.request_id
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            group.children.append(_Child(i, req, detok, logprobs=[] if params.logprobs is not None else None))
            self._child_parent[child_id] = (request_id, i)
        self._groups[request_id] = group

    # ------------------------------------------------------------------ migration
    def export_request(self, request_id: str, layers: list[int] | None = None) -> RequestSnapshot:
        """Everything needed to continue ``request_id`` elsewhere: its tokens, parameters and the
        KV of its computed tokens as plain CPU tensors (by layer). The request stays here until
        aborted, so a failed import loses nothing."""
        group = self._groups[request_id]
        if len(group.children) != 1:
            raise ValueError("only n=1 requests can be exported")
        ch = group.children[0]
        req = ch.request
        kv = self.kv_cache.export(self.kv_manager.block_table(req.request_id), layers, 0, req.num_computed_tokens)
        return RequestSnapshot(request_id, group.prompt, list(req.prompt_token_ids), list(req.output_token_ids),
                               group.params, req.num_computed_tokens, kv, req.priority, req.request_class.value,
                               text_sent=ch.sent)

    def export_kv(self, request_id: str, layers: list[int], start: int, end: int
                  ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """KV of ``layers`` for tokens ``[start, end)`` of a request (one chunk of a hand-off)."""
        return self.kv_cache.export(self.kv_manager.block_table(request_id), layers, start, end)

    def import_kv(self, request_id: str, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """Write one arriving chunk of a request imported with ``paused=True``."""
        self.kv_cache.import_(self.kv_manager.block_table(request_id), kv, start=start)

    def pause_request(self, request_id: str) -> None:
        """Stop scheduling a running request (n=1), keeping its KV (a hand-off is reading it)."""
        self.scheduler.pause(request_id)

    def resume_request(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    def has_runnable_requests(self) -> bool:
        return self.scheduler.has_runnable()

    # what a worker moving requests reads and changes (tidal.runtime.worker / group), no private field
    def request_ids(self) -> list[str]:
        """The requests this engine holds, by the ids they were added (or imported) with."""
        return list(self._groups)

    def num_sequences(self, request_id: str) -> int:
        """The sequences of ``request_id`` (its ``n``); 0 for a request not here."""
        group = self._groups.get(request_id)
        return 0 if group is None else len(group.children)

    def is_movable(self, request_id: str) -> bool:
        """A hand-off or a migration can take it with its KV: one sequence, running, past its
        prefill with a sampled token, not finished."""
        req = self.scheduler.requests.get(request_id)
        return (self.num_sequences(request_id) == 1 and req is not None and req in self.scheduler.running
                and bool(req.output_token_ids) and not req.in_prefill and not req.is_finished)

    def cancel_pause(self, request_id: str) -> None:
        """DynaServe's unsplit: an alpha part keeps the whole request (no split point; resumed if
        it already paused there)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return
        req.pause_at = None
        if request_id in self.scheduler.paused:
            self.resume_request(request_id)

    def import_request(self, snap: RequestSnapshot, paused: bool = False, hold_tokens: int | None = None) -> None:
        """Continue a request exported by another engine.

        With KV (``num_computed_tokens > 0``) its blocks are allocated at once and ``snap.kv`` is
        written into them; with ``paused`` the request waits, holding its blocks, for its KV to
        arrive in chunks (:meth:`import_kv`) until :meth:`resume_request`. Without KV
        (``num_computed_tokens == 0``) it queues like a new request and recomputes prompt and
        outputs (fail-over). Either way it continues its text where the client's stream stopped.
        ``hold_tokens`` (paused imports): blocks for only that many tokens now, the rest grown by
        :meth:`grow_import` as chunks arrive.
        """
        if snap.request_id in self._groups:
            raise RequestRejected(f"request id {snap.request_id!r} is already in use")
        req = Request(snap.request_id, list(snap.prompt_token_ids), snap.params, arrival_time=self.clock(),
                      eos_token_ids=self.eos_token_ids, priority=snap.priority,
                      request_class=RequestClass(snap.request_class))
        req.output_token_ids = list(snap.output_token_ids)
        req.num_computed_tokens = snap.num_computed_tokens
        if snap.num_computed_tokens == 0:
            self.scheduler.add_request(req)
        elif not self.scheduler.add_running(req, hold_tokens if paused else None):
            raise RequestRejected("no room in the KV cache for the imported request")
        if paused and snap.num_computed_tokens:
            self.scheduler.pause(req.request_id)
        if snap.kv:
            self.kv_cache.import_(self.kv_manager.block_table(req.request_id), snap.kv, start=0)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                       skip_special_tokens=snap.params.skip_special_tokens)
        child = _Child(0, req, detok, logprobs=[] if snap.params.logprobs is not None else None)
        if req.output_token_ids:
            child.text = detok.add_tokens(req.output_token_ids)
            child.tok_sent = len(req.output_token_ids)
            child.sent = len(child.text) if snap.text_sent is None else min(snap.text_sent, len(child.text))
        self._groups[snap.request_id] = _Group(snap.request_id, snap.prompt, list(snap.prompt_token_ids),
                                               snap.params, [child], req.arrival_time)
        self._child_parent[snap.request_id] = (snap.request_id, 0)

    def reserve_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       num_kv_tokens: int, priority: int = 0, request_class: str = "online",
                       hold_tokens: int | None = None) -> None:
        """DynaServe Sec. 4.3: take in a beta micro-request whose first ``num_kv_tokens`` of KV
        arrive in chunks (:meth:`import_kv`) while its alpha part still computes; the output tokens
        alpha sampled come last, with :meth:`finish_import`, which also resumes it. It holds blocks
        for ``hold_tokens`` of that KV now (default: all of it); :meth:`grow_import` adds the rest
        chunk by chunk, so a long split does not fill the pool before its KV exists."""
        self.import_request(RequestSnapshot(request_id, None, list(prompt_token_ids), [], params, num_kv_tokens, {},
                                            priority, request_class, text_sent=0), paused=True,
                            hold_tokens=hold_tokens)

    def grow_import(self, request_id: str, num_tokens: int) -> bool:
        """Blocks so a paused import holds its first ``num_tokens`` tokens of KV; False: no room now."""
        req = self.scheduler.paused.get(request_id)
        if req is None:
            raise ValueError(f"{request_id!r} is not a paused import")
        if num_tokens > req.num_computed_tokens:
            raise ValueError(f"{request_id}: KV up to token {num_tokens} is past its {req.num_computed_tokens}")
        return self.kv_manager.allocate(request_id, num_tokens) is not None

    def finish_import(self, request_id: str, output_token_ids: list[int], text_sent: int | None,
                      last_token_time: float | None = None) -> None:
        """Complete a :meth:`reserve_import`: set the tokens alpha sampled (the client already has
        ``text_sent`` characters of their text; alpha sampled the last one at ``last_token_time``,
        on this engine's clock: a TBT-aware policy counts the hand-off gap) and resume it."""
        group = self._groups[request_id]
        ch = group.children[0]
        req = ch.request
        if len(req.prompt_token_ids) + len(output_token_ids) < req.num_computed_tokens:
            raise ValueError(f"{request_id}: {len(output_token_ids)} output tokens cannot cover "
                             f"{req.num_computed_tokens} tokens of KV")
        if self.kv_manager.num_blocks_of(request_id) * self.kv_manager.block_size < req.num_computed_tokens:
            raise ValueError(f"{request_id}: its KV has not all arrived (blocks for "
                             f"{self.kv_manager.num_blocks_of(request_id) * self.kv_manager.block_size} of "
                             f"{req.num_computed_tokens} tokens)")
        req.output_token_ids = list(output_token_ids)
        if last_token_time is not None:
            req.last_token_time = last_token_time
        if output_token_ids:
            ch.text = ch.detok.add_tokens(req.output_token_ids)
            ch.tok_sent = len(req.output_token_ids)
            ch.sent = len(ch.text) if text_sent is None else min(text_sent, len(ch.text))
        self.scheduler.resume(request_id)

    def abort_request(self, request_ids: str | list[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        now = self.clock()
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for ch in group.children:
                self.scheduler.finish_request(ch.request.request_id, FinishReason.ABORT, now=now)
                self._child_parent.pop(ch.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule(self.clock())
        result = self.runner.execute(plan)
        self.last_plan, self.last_result = plan, result
        self.num_steps += 1
        updates = self.scheduler.update(plan, result, self.clock())
        return self._process(updates)

    def _process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        touched: dict[str, _Group] = {}
        for upd in updates:
            parent = self._child_parent.get(upd.request_id)
            if parent is None:
                continue
            group = self._groups[parent[0]]
            ch = group.children[parent[1]]
            self._apply(group, ch, upd)
            touched[group.request_id] = group
        outs = []
        for group in touched.values():
            outs.append(self._output(group))
            if all(ch.finish_reason is not None for ch in group.children):
                del self._groups[group.request_id]
                for ch in group.children:
                    self._child_parent.pop(ch.request.request_id, None)
        return outs

    def _apply(self, group: _Group, ch: _Child, upd: RequestUpdate) -> None:
        sp = group.params
        new_text = ch.detok.add_tokens(upd.new_token_ids)
        if ch.logprobs is not None:
            ch.logprobs.extend(upd.new_logprobs)
            ch.cumulative_logprob += sum(lp.logprob for lp in upd.new_logprobs)
        before = len(ch.text)
        ch.text += new_text
        if upd.finished:
            ch.text += ch.detok.flush()
            ch.finish_reason, ch.stop_reason = upd.finish_reason, upd.stop_reason
        if sp.stop and ch.stop_reason is None:
            longest = max(len(s) for s in sp.stop)
            lo = max(0, before - longest + 1)
            hits = [(ch.text.find(s, lo), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                ch.text = ch.text[: i + len(s)] if sp.include_stop_str_in_output else ch.text[:i]
                ch.finish_reason, ch.stop_reason = FinishReason.STOP.value, s
                if not upd.finished:
                    self.scheduler.finish_request(ch.request.request_id, FinishReason.STOP, s, now=self.clock())

    def _output(self, group: _Group) -> RequestOutput:
        outs = []
        longest = max((len(s) for s in group.params.stop), default=0)
        for ch in group.children:
            visible = len(ch.text)
            if ch.finish_reason is None and longest > 1:
                visible = max(ch.sent, visible - (longest - 1))  # hold back a possible stop-string prefix
            delta = ch.text[ch.sent:visible]
            ch.sent = visible
            req = ch.request
            outs.append(CompletionOutput(
                index=ch.index, text=ch.text[:visible], token_ids=list(req.output_token_ids),
                logprobs=list(ch.logprobs) if ch.logprobs is not None else None,
                cumulative_logprob=ch.cumulative_logprob if ch.logprobs is not None else None,
                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason, delta_text=delta,
                delta_token_ids=req.output_token_ids[ch.tok_sent:],
                delta_logprobs=ch.logprobs[ch.lp_sent:] if ch.logprobs else []))
            ch.tok_sent = len(req.output_token_ids)
            ch.lp_sent = len(ch.logprobs) if ch.logprobs else 0
        first = group.children[0].request
        metrics = RequestMetrics(group.arrival_time, first.first_scheduled_time, first.first_token_time,
                                 first.finish_time, sum(c.request.num_preemptions for c in group.children))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                             finished=all(ch.finish_reason is not None for ch in group.children), metrics=metrics)

    # ------------------------------------------------------------------ KunServe drop / restore
    @property
    def pool_bytes(self) -> int:
        """The memory the KV pool may use: its blocks plus what is left over below one block."""
        return self.kv_cache.nbytes + self.pool_spare_bytes

    def _set_pool(self, num_blocks: int, mem: int) -> None:
        """Resize the pool to ``num_blocks`` within ``mem`` bytes (live blocks relocated on a
        shrink); the rest of ``mem`` stays as spare bytes."""
        bpb = self.kv_cache.bytes_per_block
        if num_blocks * bpb > mem:
            raise ValueError(f"{num_blocks} blocks of {bpb} bytes do not fit in {mem} bytes")
        delta = num_blocks - self.kv_manager.num_blocks
        if delta >= 0:
            self.kv_manager.grow(delta)
            self.kv_cache.grow(delta)
        else:
            moves = self.kv_manager.shrink(-delta)
            if moves is None:
                raise ValueError(f"cannot shrink the KV pool to {num_blocks} blocks: "
                                 f"{self.kv_manager.num_blocks - self.kv_manager.num_free_blocks} are in use")
            self.kv_cache.shrink(-delta, moves)
        self.pool_spare_bytes = mem - num_blocks * bpb

    def drop_layers(self, layer_ids: list[int] | range) -> int:
        """KunServe Sec. 4.1's local memory manager: drop these decoder layers' weights and KV and
        grow the pool by the freed bytes; the pool then holds exactly ``(its KV bytes + the freed
        weight bytes) // bytes per block of the layers still here`` blocks. Block ids do not
        change (the new blocks come on top). Returns the new number of blocks."""
        ids = sorted(set(layer_ids))
        present = set(self.model.layer_ids)
        if not ids or not set(ids) <= present:
            raise ValueError(f"layers {ids} are not all present here (present: {sorted(present)})")
        if len(ids) == len(present):
            raise ValueError("an instance keeps at least one decoder layer")
        if self.kv_cache.num_host_blocks:
            raise ValueError("layers cannot be dropped with swap preemption (the host pool is per layer)")
        mem = self.pool_bytes  # before the drop: it includes the dropped layers' KV
        for i in ids:
            self.dropped_weight_bytes[i] = self.model.drop_layers([i])
            mem += self.dropped_weight_bytes[i]
        self.kv_cache.drop_layers(ids)
        self._set_pool(mem // self.kv_cache.bytes_per_block, mem)
        return self.kv_manager.num_blocks

    def stage_layer(self, layer_id: int) -> Any:
        """Sec. 4.4 overlapped with serving: load one dropped layer's weights beside the model
        (from the host copy, here the checkpoint) between steps; :meth:`restore_layers` with
        ``staged`` puts it in. The staged weights sit outside the pool until then (host memory
        here; a GPU would first shrink the pool to make room for them)."""
        if layer_id not in self.dropped_weight_bytes:
            raise ValueError(f"layer {layer_id} was not dropped here")
        return self.model.stage_layer(layer_id, self.checkpoint.weights())

    def restore_layers(self, layer_ids: list[int] | range, staged: dict[int, Any] | None = None) -> int:
        """Sec. 4.4: bring dropped layers back and shrink the pool by their weights and KV (live
        blocks relocated). Refused, changing nothing, when the blocks in use would not fit. Their
        KV starts empty: the requests in flight get theirs from the exchange back. ``staged``:
        layers already loaded by :meth:`stage_layer` (else they load now). Returns the new number
        of blocks."""
        ids = sorted(set(layer_ids))
        if not ids or not set(ids) <= set(self.dropped_weight_bytes):
            raise ValueError(f"layers {ids} were not dropped here")
        if staged is not None and sorted(staged) != ids:
            raise ValueError(f"staged layers {sorted(staged)} are not the layers to restore {ids}")
        mem = self.pool_bytes - sum(self.dropped_weight_bytes[i] for i in ids)
        bpb = kv_block_bytes(self.arch, self.kv_cache.block_size, self.kv_dtype, len(self.kv_cache.layers) + len(ids))
        n = max(0, mem) // bpb
        used = self.kv_manager.num_blocks - self.kv_manager.num_free_blocks
        if n < used:
            raise ValueError(f"cannot restore layers {ids}: {used} KV blocks are in use and only {n} would fit")
        # shrink at the current layers' block size (relocating live blocks), then add the layers
        self._set_pool(n, n * self.kv_cache.bytes_per_block)
        self.kv_cache.add_layers(ids)
        self.pool_spare_bytes = mem - n * bpb
        # on CPU host memory is device memory: the "host copy" of every layer (Sec. 4.4, also
        # for fault tolerance) is the checkpoint file itself, read (mmapped) again here
        if staged is not None:
            self.model.insert_layers(staged)
        else:
            self.model.restore_layers(ids, self.checkpoint.weights())
        for i in ids:
            del self.dropped_weight_bytes[i]
        return self.kv_manager.num_blocks

    def resize_pool(self, num_blocks: int) -> None:
        """Set the pool to ``num_blocks`` within its current bytes (a group's members agree on
        one block count: the tail's pool mirrors the head's)."""
        self._set_pool(num_blocks, self.pool_bytes)

    def set_stage_link(self, link: Any, cost: Any = None, min_tokens: int = 1) -> None:
        """Become the head of a group (``link`` to the tail; None: run alone again). ``cost``: Eq. 1
        coefficients for the lookahead microbatches (Sec. 4.3); None runs one microbatch."""
        if link is not None and self.kv_cache.num_host_blocks:
            raise ValueError("a pipeline group does not swap (the host pool holds only this stage's layers)")
        self.runner.link, self.runner.mb_cost, self.runner.mb_min_tokens = link, cost, min_tokens

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        kv = self.kv_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": kv.usage,
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "batch_size_cap": self.scheduler.last_caps.max_num_seqs,
            "token_budget": self.scheduler.last_caps.token_budget,
            "policy": self.policy.state(),  # a frozen PolicyState: safe to hand to the server's thread
        }
