"""``LLM``: the offline facade (``from tidal import LLM, SamplingParams``), shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tidal.common.progress import progress_bar
from tidal.config import OFFLINE_MAX_NUM_BATCHED_TOKENS
from tidal.core.sampling import SamplingParams
from tidal.engine.llm_engine import LLMEngine
from tidal.engine.outputs import RequestOutput

PromptType = str | list[int] | dict


class LLM:
    """Load a model once, then ``generate`` or ``chat`` on batches of prompts.

    ``LLM(model=None, **engine_args)``: ``model`` is a .gguf file or an HF directory (default:
    SmolLM2-135M-Instruct); engine arguments are the fields of the config dataclasses
    (``dtype``, ``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_memory``, ``batching``...).
    Unless given, ``max_num_batched_tokens`` is ``OFFLINE_MAX_NUM_BATCHED_TOKENS`` (2048), not the server's 512.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        if engine_args.get("max_num_batched_tokens") is None:  # offline: the larger step budget
            engine_args["max_num_batched_tokens"] = OFFLINE_MAX_NUM_BATCHED_TOKENS
        self.engine = LLMEngine.from_kwargs(model=model, **engine_args)
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an already built engine (tests and tools that share one loaded checkpoint)."""
        self = cls.__new__(cls)
        self.engine = engine
        self._ids = itertools.count()
        return self

    def get_tokenizer(self):
        return self.engine.tokenizer

    @staticmethod
    def _split_prompt(p: PromptType) -> tuple[str | list[int] | None, list[int] | None]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return None, list(p["prompt_token_ids"])
            return p["prompt"], None
        if isinstance(p, str):
            return p, None
        return None, list(p)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion as one continuous batch; outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = str(next(self._ids))
            text, toks = self._split_prompt(p)
            self.engine.add_request(rid, text, sp, prompt_token_ids=toks,
                                    priority=priority[i] if priority else 0, final_only=True)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with progress_bar(len(ids), "generate", "req", use_tqdm) as bar:
            try:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
            except BaseException:
                self.engine.abort_request(ids)  # leave nothing behind on Ctrl-C or an error
                raise
        return [done[i] for i in ids]
