"""Request: the scheduler's unit of work. Pure state, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.core.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted by swap: KV lives in host blocks
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the client or the engine


class RequestClass(str, enum.Enum):
    ONLINE = "online"  # latency-sensitive (BucketServe: ordered by earliest arrival)
    OFFLINE = "offline"  # throughput-oriented (BucketServe: SJF / LJF / FCFS)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first (as in vLLM)
    request_class: RequestClass = RequestClass.ONLINE
    max_model_len: int | None = None  # the engine's context limit (prompt + output)
    # DynaServe Sec. 3 micro-request: stop (pause) once this many tokens have KV; the rest runs elsewhere
    pause_at: int | None = None
    # names of the request's full blocks (tidal.core.block_hash), extended as tokens are computed; a
    # creator may name some ahead (the simulator, from a trace's hash ids)
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # --- mutable state ---
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # when its latest output token was sampled (a hand-off carries it)
    finish_time: float | None = None
    length_limit: int | None = field(default=None, repr=False)  # max_output_tokens, once a token is checked
    num_cached_tokens: int | None = None  # prompt tokens its first admission found cached (None: not admitted)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")

    @property
    def cache_salt(self) -> str | None:
        """Prefix caching's tenant key: requests with different salts never share KV blocks."""
        return self.sampling_params.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while more than one token is uncomputed (prompt, or recompute after preemption)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens > 1

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def max_output_tokens(self) -> int:
        """How many tokens this request may still produce in total (max_tokens and context)."""
        limit = self.sampling_params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - self.num_prompt_tokens
            limit = room if limit is None else min(limit, room)
        return limit if limit is not None else 1 << 30

    @property
    def expected_total_tokens(self) -> int:
        """Prompt plus the most output it may produce: what length-aware policies plan with."""
        return self.num_prompt_tokens + self.max_output_tokens

    def check_stop(self) -> tuple[FinishReason, int | None] | None:
        """Stop conditions that depend only on token ids (stop strings are the engine's job)."""
        out = self.output_token_ids
        if not out:
            return None
        n = len(out)
        sp = self.sampling_params
        if n >= sp.min_tokens:
            last = out[-1]
            if not sp.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP, None
            if last in sp.stop_token_ids:
                return FinishReason.STOP, last
        if n >= self.output_limit():
            return FinishReason.LENGTH, None
        return None

    def output_limit(self) -> int:
        """:attr:`max_output_tokens`, computed once: :meth:`check_stop` asks for every sampled token
        (its inputs are fixed once the scheduler holds the request, which sets max_model_len)."""
        limit = self.length_limit
        if limit is None:
            limit = self.length_limit = self.max_output_tokens
        return limit
