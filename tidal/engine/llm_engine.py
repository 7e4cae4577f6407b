"""LLMEngine: one instance of the real shell, composed of its parts.

- :class:`~tidal.engine.engine_core.EngineCore`: the model, the paged KV, the pure scheduler;
  ``step`` is schedule -> execute -> update and returns the scheduler's token updates.
- :class:`~tidal.engine.output_processor.OutputProcessor`: those updates become outputs
  (incremental detokenization, stop strings, ``n > 1`` fan-out); the sequences a stop string
  ended come back to be finished here, never from inside its loop.
- :class:`~tidal.engine.transfer.KVTransfer` (``engine.transfer``): a request's KV out and in
  (hand-offs, migration, DynaServe's split), what runtime workers call.
- :class:`~tidal.engine.pool.PoolResizer` (``engine.pool``): KunServe's layer drop / restore.

Requests are validated by :mod:`tidal.core.validation` (here: the prompt, its id and
``max_tokens``; the scheduler: each sequence's id, context and KV room). ``step()`` runs one step and returns the outputs that changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tidal.config import EngineConfig
from tidal.core.request import FinishReason, Request, RequestClass
from tidal.core.sampling import SamplingParams
from tidal.core.validation import check_context, check_prompt_tokens, check_request_id
from tidal.engine.engine_core import EngineCore, prepare_device
from tidal.engine.loader import LoadedCheckpoint, load_checkpoint
from tidal.engine.output_processor import OutputProcessor
from tidal.engine.outputs import RequestOutput
from tidal.engine.pool import PoolResizer
from tidal.engine.sizing import dtype_name, resolve_device, resolve_dtype
from tidal.engine.tokenizer import Tokenizer
from tidal.engine.transfer import KV, KVTransfer, RequestSnapshot
from tidal.policies import build_policy


class LLMEngine:
    # CPU: decode steps run GraphedDecode's padded static step eagerly (no graphs on CPU): how the tests
    # check the step a CUDA graph captures; never set outside tests
    static_decode_on_cpu = False

    def __init__(self, config: EngineConfig | None = None, checkpoint: LoadedCheckpoint | None = None,
                 tokenizer: Tokenizer | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = config = config or EngineConfig()
        self._clock = clock  # the scheduler's "now"; a test can drive the engine on a virtual clock
        device = prepare_device(config)
        policy = build_policy(config.scheduler)  # a bad --batching / --policy-arg fails here, before the weights load
        ckpt = checkpoint or load_checkpoint(config.model.model)
        self.core = core = EngineCore(config, device, ckpt, policy, self.static_decode_on_cpu)
        self.outputs = OutputProcessor(tokenizer or Tokenizer.from_checkpoint(ckpt))
        self.max_model_len = core.max_model_len
        tok = self.tokenizer
        self.eos_token_ids = tuple(core.arch.eos_token_ids) or (
            (tok.eos_token_id,) if tok.eos_token_id is not None else ())
        self.transfer = KVTransfer(core, self.outputs, clock, self.eos_token_ids)  # no reference back here: an
        # engine dropped is freed at once (its KV pool with it), not at the next cyclic collection
        self.pool = PoolResizer(core)
        # the parts' objects, as the engine's attributes (tests, the server and benchmarks read them)
        self.device, self.policy, self.checkpoint, self.arch = core.device, core.policy, core.checkpoint, core.arch
        self.dtype, self.kv_dtype, self.quantization, self.model = core.dtype, core.kv_dtype, core.quantization, core.model
        self.kv_cache, self.kv_manager, self.scheduler, self.runner = (core.kv_cache, core.kv_manager, core.scheduler,
                                                                       core.runner)

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._clock = self.transfer.clock = clock

    @property
    def tokenizer(self) -> Tokenizer:
        return self.outputs.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer) -> None:
        self.outputs.tokenizer = tokenizer

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def describe_weights(self) -> str:
        """What runs the model, as start-up prints it: ``"bfloat16, weights: int4 for ..."``."""
        return self.core.describe_weights()

    @property
    def attention_backend(self) -> str:
        """What attends: ``triton``, ``tidal-cpu`` (tidal's C++ kernels) or ``torch``."""
        return self.model.attention_backend

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs."""
        return self.core.cuda_graphs

    @property
    def last_plan(self):
        return self.core.last_plan

    @property
    def last_result(self):
        return self.core.last_result

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, *, prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    request_class: str | RequestClass = RequestClass.ONLINE, pause_at: int | None = None,
                    final_only: bool = False) -> None:
        """Queue a request. ``pause_at`` (n=1 only) makes it DynaServe's alpha micro-request: it
        pauses, holding its KV, once that many tokens have KV (``transfer.drain_reached_pause``).
        Refused (:class:`~tidal.core.validation.RequestRejected`) as :mod:`tidal.core.validation` says.
        ``final_only``: :meth:`step` returns its output once, finished (``OutputProcessor.add_request``)."""
        params = params or SamplingParams()
        if pause_at is not None and (params.n != 1 or pause_at < 1):
            raise ValueError("pause_at needs n=1 and a split point >= 1")
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.tokenizer.encode(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        check_prompt_tokens(prompt_token_ids or [], self.arch.vocab_size)
        check_request_id(request_id, self.outputs)
        check_context(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        arrival = self.clock() if arrival_time is None else arrival_time
        reqs = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            reqs.append(Request(child_id, list(prompt_token_ids), child_params, arrival_time=arrival,
                                eos_token_ids=self.eos_token_ids, priority=priority,
                                request_class=RequestClass(request_class), pause_at=pause_at))
        self.core.add_requests(reqs)  # the scheduler checks each sequence's id, context and KV room
        self.outputs.add_request(request_id, text, params, reqs, arrival, final_only=final_only)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``); blocks in use stay.
        Returns the cached blocks dropped."""
        return self.core.kv_manager.reset_prefix_cache()

    def abort_request(self, request_ids: str | list[str]) -> None:
        self.transfer.free(request_ids)

    def has_unfinished_requests(self) -> bool:
        return len(self.outputs) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs)

    def has_runnable_requests(self) -> bool:
        return self.scheduler.has_runnable() or self.core.inflight is not None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        updates = self.core.step(self.clock)
        processed = self.outputs.process(updates, self.clock())
        for stop in processed.to_finish:  # a stop string ended it: free its blocks now
            self.core.finish([stop.request_id], FinishReason.STOP, stop.now, stop.stop_reason)
        return processed.outputs

    # ------------------------------------------------------------------ KV transfer (engine.transfer)
    def export_request(self, request_id: str, layers: list[int] | None = None) -> RequestSnapshot:
        return self.transfer.export_request(request_id, layers)

    def export_kv(self, request_id: str, layers: list[int], start: int, end: int) -> KV:
        return self.transfer.export_kv(request_id, layers, start, end)

    def import_kv(self, request_id: str, kv: KV, start: int) -> None:
        self.transfer.import_kv(request_id, kv, start)

    def pause_request(self, request_id: str) -> None:
        self.transfer.pause(request_id)

    def resume_request(self, request_id: str) -> None:
        self.transfer.resume(request_id)

    def request_ids(self) -> list[str]:
        return self.transfer.request_ids()

    def num_sequences(self, request_id: str) -> int:
        return self.transfer.num_sequences(request_id)

    def is_movable(self, request_id: str) -> bool:
        return self.transfer.is_movable(request_id)

    def cancel_pause(self, request_id: str) -> None:
        self.transfer.cancel_pause(request_id)

    def import_request(self, snap: RequestSnapshot, paused: bool = False, hold_tokens: int | None = None) -> None:
        self.transfer.import_request(snap, paused, hold_tokens)

    def reserve_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       num_kv_tokens: int, priority: int = 0, request_class: str = "online",
                       hold_tokens: int | None = None) -> None:
        self.transfer.reserve_import(request_id, prompt_token_ids, params, num_kv_tokens, priority, request_class,
                                     hold_tokens)

    def grow_import(self, request_id: str, num_tokens: int) -> bool:
        return self.transfer.grow_import(request_id, num_tokens)

    def import_reused(self, request_id: str) -> int:
        return self.transfer.import_reused(request_id)

    def finish_import(self, request_id: str, output_token_ids: list[int], text_sent: int | None,
                      last_token_time: float | None = None) -> None:
        self.transfer.finish_import(request_id, output_token_ids, text_sent, last_token_time)

    # ------------------------------------------------------------------ KunServe (engine.pool)
    @property
    def pool_bytes(self) -> int:
        return self.pool.pool_bytes

    @property
    def pool_spare_bytes(self) -> int:
        return self.pool.pool_spare_bytes

    @property
    def dropped_weight_bytes(self) -> dict[int, int]:
        return self.pool.dropped_weight_bytes

    def drop_layers(self, layer_ids: list[int] | range) -> int:
        return self.pool.drop_layers(layer_ids)

    def stage_layer(self, layer_id: int) -> Any:
        return self.pool.stage_layer(layer_id)

    def restore_layers(self, layer_ids: list[int] | range, staged: dict[int, Any] | None = None) -> int:
        return self.pool.restore_layers(layer_ids, staged)

    def resize_pool(self, num_blocks: int) -> None:
        self.pool.resize_pool(num_blocks)

    def set_stage_link(self, link: Any, cost: Any = None, min_tokens: int = 1) -> None:
        """Become the head of a group (``link`` to the tail; None: run alone again). ``cost``: Eq. 1
        coefficients for the lookahead microbatches (Sec. 4.3); None runs one microbatch."""
        if link is not None and (self.scheduler.preemption_mode == "swap" or self.scheduler.swapped):
            raise ValueError("a pipeline group does not swap (the host pool holds only this stage's layers)")
        self.runner.link, self.runner.mb_cost, self.runner.mb_min_tokens = link, cost, min_tokens

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, Any]:
        return self.core.stats()


# dtype_name, resolve_device, resolve_dtype (tidal.engine.sizing) and RequestSnapshot (tidal.engine.transfer):
# importable from here as before
__all__ = ["LLMEngine", "RequestSnapshot", "dtype_name", "resolve_device", "resolve_dtype"]
