"""SamplingParams: how one request is decoded. Pure data, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (for OpenAI-style errors)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Decoding parameters, named as in vLLM / the OpenAI API.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k. ``logprobs`` is the number
    of top alternatives returned with each sampled token (``0`` = only the sampled token's
    logprob, ``None`` = no logprobs).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # not a sampling knob: the prefix cache's tenant key (requests with different salts never share KV
    # blocks), kept here so that every copy of a request (moves, fail-over, n > 1) carries it
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.n < 1:
            raise SamplingParamsError("n", f"n must be >= 1, got {self.n}")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise SamplingParamsError("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k is None:
            self.top_k = 0
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", "min_tokens must not exceed max_tokens")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63 - self.n:
            raise SamplingParamsError("seed", f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise SamplingParamsError("cache_salt", "cache_salt must be a non-empty string")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def clone(self, **changes) -> SamplingParams:
        return replace(self, **changes)
