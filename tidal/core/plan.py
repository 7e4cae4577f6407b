"""The typed plan the scheduler hands to an executor, and the typed result it gets back.

One plan, one result across every boundary (engine runner, simulator, remote worker): the plan
says how many tokens each request advances this step (no separate prefill and decode phases);
the result carries the sampled tokens, the measured (or simulated) step time and the batch
composition that the controllers and the cost model learn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tidal.core.sampling import SamplingParams

# a decode chunk's token while the step before it still runs: the executor takes that step's sample
# for the request (Scheduler.plan_overlapped, --async-scheduling)
PENDING_TOKEN = -1


@dataclass(slots=True)
class ScheduledChunk:
    """One request's share of a step: feed ``token_ids`` at positions ``start..``."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int  # position of token_ids[0] (== tokens already in the KV cache)
    block_table: tuple[int, ...]
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    sampling: SamplingParams
    output_index: int = 0  # index of the token to be sampled among the request's outputs

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens in the cache after this step."""
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 and self.start > 0


@dataclass(frozen=True, slots=True)
class BatchComposition:
    """What a step computed: the features a cost model or a profile table is keyed on."""

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    context_lens: tuple[int, ...] = ()  # per scheduled request, after the step
    num_padded_tokens: int = 0  # tokens computed only as padding (static batching)

    @property
    def batch_size(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def mean_context(self) -> float:
        return sum(self.context_lens) / len(self.context_lens) if self.context_lens else 0.0

    @staticmethod
    def of(chunks: tuple[ScheduledChunk, ...] | list[ScheduledChunk], num_padded_tokens: int = 0) -> BatchComposition:
        pre_tokens = pre_seqs = 0
        ctx = []
        for c in chunks:  # one pass: this runs every step of the engine and the simulator
            n, start = len(c.token_ids), c.start
            if n != 1 or start == 0:  # not a decode (see ScheduledChunk.is_decode)
                pre_tokens += n
                pre_seqs += 1
            ctx.append(start + n)
        return BatchComposition(num_prefill_tokens=pre_tokens, num_prefill_seqs=pre_seqs,
                                num_decode_seqs=len(chunks) - pre_seqs, context_lens=tuple(ctx),
                                num_padded_tokens=num_padded_tokens)


def rectangle_padding(chunks: tuple[ScheduledChunk, ...] | list[ScheduledChunk], extra_rows: int = 0) -> int:
    """Padded tokens of a step run as a rectangle (static batching, BucketServe Eq. 1's S_max x N):
    ``rows = len(chunks) + extra_rows`` rows, each as long as the longest chunk, so
    ``rows * max_n - sum(n_i)``. ``extra_rows`` are rows kept for finished members (each a dead
    decode row)."""
    if not chunks:
        return 0
    longest = max(len(c.token_ids) for c in chunks)
    return (len(chunks) + extra_rows) * longest - sum(len(c.token_ids) for c in chunks)


@dataclass(frozen=True, slots=True)
class StepPlan:
    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    composition: BatchComposition
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block), done first
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block), done before compute
    preempted: tuple[str, ...] = ()
    finished: tuple[str, ...] = ()  # requests ended since the last plan: executors drop their state

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def describe(self) -> tuple:
        """A hashable summary used to compare plans across shells (engine vs simulator)."""
        return (tuple((c.request_id, c.start, c.num_tokens, c.sample) for c in self.chunks),
                self.preempted, len(self.swap_out), len(self.swap_in))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class StepResult:
    step_id: int
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> sampled token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    step_time_s: float = 0.0  # measured (engine) or predicted (simulator)
    composition: BatchComposition = field(default_factory=BatchComposition)


@dataclass(slots=True)
class RequestUpdate:
    """What a step did to one request, for the output side (detokenizer, streams, metrics)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Sequence[TokenLogprobs] = ()  # one per new token when logprobs were asked for
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
