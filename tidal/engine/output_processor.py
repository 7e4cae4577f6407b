"""The engine's output side: a step's token updates become the client's outputs.

Incremental detokenization, stop strings (with the held-back text a stop string may still
complete), logprobs and ``n > 1`` fan-out. It never calls the scheduler: a stop string that ends
a sequence the scheduler still runs is *returned* (:attr:`ProcessedOutputs.to_finish`) and the
engine finishes it, the split vLLM v1 makes between its engine core and its OutputProcessor.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from tidal.core.plan import RequestUpdate
from tidal.core.request import FinishReason, Request
from tidal.core.sampling import SamplingParams
from tidal.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tidal.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SequenceState:
    """One sequence of a request (one of its ``n``): its text and what the client has of it."""

    index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # all text so far (after stop-string truncation)
    sent: int = 0  # characters already emitted
    tok_sent: int = 0  # token ids already emitted
    lp_sent: int = 0  # logprob entries already emitted
    logprobs: list | None = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_time: float | None = None  # when a stop string ended it (the scheduler finishes it then)
    deferred: list[int] | None = None  # a final-only request's ids, detokenized once when it finishes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    """A client's request: its prompt, parameters and sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    arrival_time: float
    final_only: bool = False  # one output, when every sequence has finished (LLM.generate's)


@dataclass(frozen=True)
class StopFinish:
    """A sequence a stop string ended while the scheduler still runs it: finish it (STOP)."""

    request_id: str
    stop_reason: str
    now: float


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput]
    to_finish: list[StopFinish]  # the engine finishes these in the scheduler (frees their blocks)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self._parent: dict[str, tuple[str, int]] = {}  # sequence id -> (request id, index)

    # ------------------------------------------------------------------ requests in / out
    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[str]:
        return iter(self.states)

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams,
                    sequences: list[Request], arrival_time: float, final_only: bool = False) -> RequestState:
        """Track a request whose ``sequences`` (its ``n`` children) the scheduler now holds. ``final_only``
        (vLLM's ``RequestOutputKind.FINAL_ONLY``, what ``LLM.generate`` reads): no output until every sequence
        has finished, and, where no stop string needs the text as it grows, each sequence's text decoded once
        at its end (the same text: the detokenizer's output does not depend on how its ids arrive)."""
        state = RequestState(request_id, prompt, list(sequences[0].prompt_token_ids), params, [], arrival_time,
                             final_only=final_only)
        for i, req in enumerate(sequences):
            detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens)
            state.sequences.append(SequenceState(i, req, detok, logprobs=[] if params.logprobs is not None else None,
                                                 deferred=[] if final_only and not params.stop else None))
            self._parent[req.request_id] = (request_id, i)
        self.states[request_id] = state
        return state

    def continue_text(self, request_id: str, text_sent: int | None) -> None:
        """A moved request's tokens so far (``request.output_token_ids``) are text the client
        already has ``text_sent`` characters of (None: all of it); later outputs continue there."""
        seq = self.states[request_id].sequences[0]
        out = seq.request.output_token_ids
        if out:
            seq.text = seq.detok.add_tokens(out)
            seq.tok_sent = len(out)
            seq.sent = len(seq.text) if text_sent is None else min(text_sent, len(seq.text))

    def remove(self, request_id: str) -> RequestState | None:
        """Stop tracking a request (aborted, or moved elsewhere); its state, or None."""
        state = self.states.pop(request_id, None)
        if state is not None:
            for seq in state.sequences:
                self._parent.pop(seq.request.request_id, None)
        return state

    # ------------------------------------------------------------------ a step's updates
    def process(self, updates: list[RequestUpdate], now: float) -> ProcessedOutputs:
        """The outputs of the requests ``updates`` touched (finished ones stop being tracked), and
        the sequences a stop string ended at ``now`` that the scheduler must still finish."""
        touched: dict[str, RequestState] = {}
        to_finish: list[StopFinish] = []
        for upd in updates:
            parent = self._parent.get(upd.request_id)
            if parent is None:
                continue
            state = self.states[parent[0]]
            seq = state.sequences[parent[1]]
            if self._apply(state.params, seq, upd):
                seq.stop_time = now
                to_finish.append(StopFinish(upd.request_id, str(seq.stop_reason), now))
            touched[state.request_id] = state
        outs = []
        for state in touched.values():
            done = all(seq.finished for seq in state.sequences)
            if done or not state.final_only:
                outs.append(self._output(state))
            if done:
                self.remove(state.request_id)
        return ProcessedOutputs(outs, to_finish)

    @staticmethod
    def _apply(sp: SamplingParams, seq: SequenceState, upd: RequestUpdate) -> bool:
        """Add one update's tokens to ``seq``; True when a stop string ended a sequence the
        scheduler has not finished."""
        if seq.logprobs is not None:
            seq.logprobs.extend(upd.new_logprobs)
            seq.cumulative_logprob += sum(lp.logprob for lp in upd.new_logprobs)
        if seq.deferred is not None:  # final-only, no stop strings: the text once, at the end
            seq.deferred.extend(upd.new_token_ids)
            if upd.finished:
                seq.text = seq.detok.add_tokens(seq.deferred) + seq.detok.flush()
                seq.finish_reason, seq.stop_reason = upd.finish_reason, upd.stop_reason
            return False
        new_text = seq.detok.add_tokens(upd.new_token_ids)
        before = len(seq.text)
        seq.text += new_text
        if upd.finished:
            seq.text += seq.detok.flush()
            seq.finish_reason, seq.stop_reason = upd.finish_reason, upd.stop_reason
        if sp.stop and seq.stop_reason is None:
            longest = max(len(s) for s in sp.stop)
            lo = max(0, before - longest + 1)
            hits = [(seq.text.find(s, lo), s) for s in sp.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s)] if sp.include_stop_str_in_output else seq.text[:i]
                seq.finish_reason, seq.stop_reason = FinishReason.STOP.value, s
                return not upd.finished
        return False

    @staticmethod
    def _output(state: RequestState) -> RequestOutput:
        outs = []
        longest = max((len(s) for s in state.params.stop), default=0)
        for seq in state.sequences:
            visible = len(seq.text)
            if seq.finish_reason is None and longest > 1:
                visible = max(seq.sent, visible - (longest - 1))  # hold back a possible stop-string prefix
            delta = seq.text[seq.sent:visible]
            seq.sent = visible
            req = seq.request
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text[:visible], token_ids=list(req.output_token_ids),
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, delta_text=delta,
                delta_token_ids=req.output_token_ids[seq.tok_sent:],
                delta_logprobs=seq.logprobs[seq.lp_sent:] if seq.logprobs else []))
            seq.tok_sent = len(req.output_token_ids)
            seq.lp_sent = len(seq.logprobs) if seq.logprobs else 0
        first = state.sequences[0]
        finish_time = first.request.finish_time if first.request.finish_time is not None else first.stop_time
        metrics = RequestMetrics(state.arrival_time, first.request.first_scheduled_time, first.request.first_token_time,
                                 finish_time, sum(s.request.num_preemptions for s in state.sequences))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             finished=all(s.finished for s in state.sequences), metrics=metrics,
                             num_cached_tokens=first.request.num_cached_tokens)
