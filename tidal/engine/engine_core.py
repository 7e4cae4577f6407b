"""The engine core: the model, its paged KV, the pure scheduler, and the step loop.

``step`` is schedule -> execute -> update (vLLM v1's EngineCore): it returns the scheduler's
:class:`~tidal.core.plan.RequestUpdate` s and knows nothing of text. Requests come in as
:class:`~tidal.core.request.Request` s (validated by the scheduler, :mod:`tidal.core.validation`)
and leave by :meth:`finish` (a stop string the output side found, an abort).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tidal.common.progress import startup_line, startup_phase
from tidal.config import EngineConfig, default_cpu_threads, swap_space_warning
from tidal.core.kv_manager import KVCacheManager
from tidal.core.plan import RequestUpdate, StepPlan, StepResult
from tidal.core.policy import SchedulingPolicy
from tidal.core.request import FinishReason, Request
from tidal.core.scheduler import RequestRejected, Scheduler
from tidal.engine.cuda_graph import GraphedDecode
from tidal.engine.kv_cache import PagedKVCache, kv_block_bytes
from tidal.engine.loader import LoadedCheckpoint
from tidal.engine.model import LlamaModel
from tidal.engine.quant import describe_quantization
from tidal.engine.runner import InFlight, ModelRunner
from tidal.engine.sizing import num_kv_blocks, resolve_device, resolve_dtype

log = logging.getLogger("tidal.engine")


def prepare_device(config: EngineConfig) -> torch.device:
    """The engine's device (``--device``), with torch's CPU threads and seed set for it."""
    mc = config.model
    device = resolve_device(mc.device)
    if device.type == "cpu":
        torch.set_num_threads(mc.num_threads or default_cpu_threads())
    torch.manual_seed(mc.seed)
    return device


class EngineCore:
    def __init__(self, config: EngineConfig, device: torch.device, checkpoint: LoadedCheckpoint,
                 policy: SchedulingPolicy, static_decode_on_cpu: bool = False):
        """``device``: :func:`~tidal.engine.sizing.resolve_device`'s, resolved (and its threads and
        seed set, :func:`prepare_device`) before the checkpoint loads."""
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        self.device = device
        self.policy = policy
        self.checkpoint = ckpt = checkpoint
        self.arch = arch = ckpt.arch
        self.dtype = resolve_dtype(mc.dtype, self.device, 4 * arch.num_params())
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
        graphs = ((self.device.type == "cuda" or static_decode_on_cpu) and not mc.enforce_eager and not mc.compile
                  and self.model.is_first and self.model.is_last)
        block_bytes = kv_block_bytes(arch, cc.block_size, self.kv_dtype, len(layer_ids))
        num_blocks = num_kv_blocks(config, self.device, arch, block_bytes, self.max_model_len, self.dtype, graphs)
        # one host pool: swapped-out requests (swap mode, or any mode --kv-pressure auto may switch to swap)
        # and the prefix cache's host tier share it
        num_swap = cc.swap_space // block_bytes if sc.preemption_mode == "swap" or sc.swap_pool else 0
        num_host = num_swap + cc.kv_offloading_size // block_bytes
        self.swap_warning = swap_space_warning(num_swap, cc.block_size, self.max_model_len, cc.swap_space) \
            if sc.preemption_mode == "swap" else None
        if self.swap_warning:
            startup_line(f"warning: {self.swap_warning}")
        self.kv_cache = PagedKVCache(arch, layer_ids, num_blocks, cc.block_size, self.kv_dtype, self.device, num_host,
                                     scratch_block=graphs)
        self.kv_manager = KVCacheManager(num_blocks, cc.block_size, num_host, enable_caching=cc.enable_prefix_caching,
                                         host_tier=cc.kv_offloading_size > 0)
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
        self.async_scheduling = mc.async_scheduling
        if mc.async_scheduling and not graphs:
            startup_line("note: --async-scheduling overlaps the decode steps of CUDA graphs, which this engine does "
                         "not run (CPU, --enforce-eager, --compile or a pipeline stage): its steps run as without it")
        self.inflight: InFlight | None = None  # a decode step launched, its samples not yet applied
        self.overlapped_steps = 0  # steps planned and launched while the step before ran
        self.last_result: StepResult | None = None
        self.last_plan: StepPlan | None = None
        self.num_steps = 0
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d; weights: %s",
                 ckpt.path, self.device, self.dtype, num_blocks, cc.block_size, self.max_model_len,
                 describe_quantization(self.quantization))

    # ------------------------------------------------------------------ requests
    def add_requests(self, reqs: list[Request]) -> None:
        """Queue the sequences of one request: all of them or, when one is refused, none."""
        added: list[str] = []
        try:
            for req in reqs:
                self.scheduler.add_request(req)
                added.append(req.request_id)
        except RequestRejected:
            self.scheduler.abort_requests(added)
            raise

    def finish(self, request_ids: Iterable[str], reason: FinishReason, now: float,
               stop_reason: int | str | None = None) -> None:
        """End these sequences (a stop string, an abort) and free their blocks."""
        for rid in request_ids:
            self.scheduler.finish_request(rid, reason, stop_reason, now=now)

    # ------------------------------------------------------------------ step
    def step(self, clock: Callable[[], float]) -> list[RequestUpdate]:
        """One step: schedule at ``clock()``, run the plan on the model, apply its result.

        With ``--async-scheduling`` (vLLM's async scheduling), a decode step the graphs take runs ahead
        of the host: it is launched, the next decode step is planned and launched behind it (its
        tokens are the first one's samples, fed on the device), and only then does the host wait for
        the first step's samples and apply them. Scheduling, the token bookkeeping and the output side
        run while the device computes. A step that cannot follow so (a request joins, a prefill, a
        preemption) is planned by ``schedule`` once the step before is applied."""
        if self.inflight is None:
            plan = self.scheduler.schedule(clock())
            if not (self.async_scheduling and self.runner.can_overlap(plan)):
                return self._apply(plan, self.runner.execute(plan), clock)
            self.inflight = self.runner.launch(plan)
        step = self.inflight
        nxt = self.scheduler.plan_overlapped(step.plan) if self.runner.overlap_ready() else None
        self.inflight = self.runner.launch(nxt, after=step) if nxt is not None else None
        self.overlapped_steps += nxt is not None
        return self._apply(step.plan, self.runner.collect(step), clock)

    def _apply(self, plan: StepPlan, result: StepResult, clock: Callable[[], float]) -> list[RequestUpdate]:
        self.last_plan, self.last_result = plan, result
        self.num_steps += 1
        return self.scheduler.update(plan, result, clock())

    # ------------------------------------------------------------------ introspection
    def describe_weights(self) -> str:
        """What runs the model, as start-up prints it: ``"bfloat16, weights: int4 for ..."``."""
        compiled = "; decode steps compiled (--compile)" if self.runner.compiled is not None else ""
        compiled += "; decode steps as CUDA graphs" if self.cuda_graphs else ""
        compiled += ", each planned while the one before runs (--async-scheduling)" if (
            self.cuda_graphs and self.async_scheduling) else ""
        attention = {"tidal-cpu": "; decode attention: tidal's paged kernel",
                     "triton": "; attention: Triton paged kernels"}.get(self.model.attention_backend, "")
        kv = f"; KV cache {str(self.kv_dtype).removeprefix('torch.')}" if self.kv_dtype != self.dtype else ""
        return (f"{str(self.dtype).removeprefix('torch.')}, weights: {describe_quantization(self.quantization)}"
                f"{attention}{kv}{compiled}")

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self.runner.graphs is not None and self.runner.graphs.capture

    def stats(self) -> dict[str, Any]:
        kv = self.kv_manager
        return {
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "kv_cache_usage_perc": kv.usage,
            "num_kv_blocks": kv.num_blocks,
            "num_free_kv_blocks": kv.num_free_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_caching": kv.enable_caching,
            "prefix_cache_queries": self.scheduler.prefix_queries,  # prompt tokens looked up (tokens)
            "prefix_cache_hits": self.scheduler.prefix_hits,  # of them found cached (device pool or host tier)
            "prefix_cache_host_hits": self.scheduler.prefix_host_hits,
            "num_cached_kv_blocks": kv.num_cached_blocks,
            "num_host_kv_blocks": kv.host_pool.num_blocks if kv.host_tier else 0,
            "num_swap_preemptions": self.scheduler.num_swap_preemptions,
            "num_swap_fallbacks": self.scheduler.num_swap_fallbacks,
            "batch_size_cap": self.scheduler.last_caps.max_num_seqs,
            "token_budget": self.scheduler.last_caps.token_budget,
            "policy": self.policy.state(),  # a frozen PolicyState: safe to hand to the server's thread
        }
