"""Multi-turn conversations (pure): every turn resends the whole history plus a new user message.

``--workload conversation[:KEY=VALUE,...]``. Conversations start at the arrivals of the usual
process (``--rate`` conversations a second, ``--burstiness``); turn k's prompt is the system prompt
(when there is one), every earlier user message and answer of its conversation, and a new user
message; its answer is ``output_len`` tokens. Turn k + 1 is sent ``think_s`` after turn k's response
ended (exponential think times): a closed loop per conversation, which the load client
(:mod:`tidal.bench.client`) and the simulator (:mod:`tidal.sim.simulator`) both run. A turn's
``arrival_s`` here is only its earliest time: its conversation's start plus the think times so far.

Content is named, not drawn per request: every system prompt, user message and answer is a
:class:`~tidal.workload.spec.Segment` with its own content id, so turn k + 1's prompt is turn k's
prompt + its answer + the new message, span for span, and two requests share a prefix exactly where
their spans are equal. The simulator names KV blocks from the spans
(:func:`tidal.core.block_hash.span_block_names`); the load client sends equal content for equal
ids (:func:`materialize_conversations`) and, for an answer, what the server actually returned.

Keys (our defaults: no trace we have gives per-message lengths or think times):

* ``conversations=N``: how many (default: as many as ``--num-requests`` turns, or 100 turns, or
  ``--duration`` of starts allow); ``--num-requests`` caps the turns of all conversations together
  (the conversation at the cap ends there);
* ``turns=N`` (fixed) or ``turns=A-B`` (uniform), or ``turns_mean=M``: geometric with mean M
  (default 4), at most ``max_turns`` (default 32);
* ``system=N``: tokens of a system prompt shared by conversations (default 0: none); ``systems=K``
  distinct ones, each conversation drawing one (default 1);
* ``user=MEAN``, ``user_sigma=S``: user-message tokens, lognormal (default 128, 0.8);
* ``answer=MEAN``, ``answer_sigma=S``: answer tokens, lognormal (default 256, 0.8);
* ``think=SECONDS``: mean think time, exponential (default 5; 0: the next turn at once).

``--max-input-len`` ends a conversation before the turn whose prompt would exceed it (a first
turn's message is cut to fit); ``--max-output-len`` caps answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tidal.workload.requests import (
    PromptMaker,
    WorkloadError,
    _parse_range,
    arrivals_within,
    gamma_arrivals,
    lognormal_lengths,
    rescale_to_rate,
)
from tidal.workload.spec import RequestSpec, Segment

DEFAULT_TURNS = 100  # requests (turns) of a conversation workload bounded by nothing else

_KEYS: dict[str, type] = {"conversations": int, "turns": str, "turns_mean": float, "max_turns": int, "system": int,
                          "systems": int, "user": float, "user_sigma": float, "answer": float,
                          "answer_sigma": float, "think": float}


@dataclass(frozen=True)
class ConversationShape:
    conversations: int | None = None
    turns: tuple[int, int] | None = None  # uniform in [lo, hi]; None: geometric with turns_mean
    turns_mean: float = 4.0
    max_turns: int = 32
    system: int = 0
    systems: int = 1
    user: float = 128.0
    user_sigma: float = 0.8
    answer: float = 256.0
    answer_sigma: float = 0.8
    think: float = 5.0

    def draw_turns(self, rng: np.random.Generator) -> int:
        if self.turns is not None:
            return int(rng.integers(self.turns[0], self.turns[1] + 1))
        return min(self.max_turns, int(rng.geometric(1.0 / self.turns_mean)))


def is_conversation(name: str | None) -> bool:
    return name is not None and (name == "conversation" or name.startswith("conversation:"))


def parse_conversation(name: str) -> ConversationShape:
    """The shape ``conversation[:KEY=VALUE,...]`` names (module docstring); WorkloadError if bad."""
    if not is_conversation(name):
        raise WorkloadError(f"not a conversation workload: {name!r}")
    rest = name.partition(":")[2]
    vals: dict[str, Any] = {}
    for item in (x.strip() for x in rest.split(",")):
        if not item:
            continue
        key, sep, value = (p.strip() for p in item.partition("="))
        if not sep or key not in _KEYS:
            raise WorkloadError(f"bad workload {name!r}: {item!r} is not KEY=VALUE with a key of "
                                f"{', '.join(_KEYS)}")
        if key in vals:
            raise WorkloadError(f"bad workload {name!r}: {key} given twice")
        try:
            vals[key] = _parse_range(value, "turns") if key == "turns" else _KEYS[key](value)
        except ValueError:
            raise WorkloadError(f"bad workload {name!r}: {key}={value!r} is not a number") from None
        if isinstance(vals[key], float) and not math.isfinite(vals[key]):
            raise WorkloadError(f"bad workload {name!r}: {key} must be finite")
    if "turns" in vals and "turns_mean" in vals:
        raise WorkloadError(f"bad workload {name!r}: give turns or turns_mean, not both")
    shape = ConversationShape(**vals)
    checks = ((shape.conversations is None or shape.conversations >= 1, "conversations must be >= 1"),
              (shape.turns_mean >= 1, "turns_mean must be >= 1"), (shape.max_turns >= 1, "max_turns must be >= 1"),
              (shape.system >= 0, "system must be >= 0"), (shape.systems >= 1, "systems must be >= 1"),
              (shape.user > 0 and shape.answer > 0, "user and answer must be > 0"),
              (shape.user_sigma >= 0 and shape.answer_sigma >= 0, "sigmas must be >= 0"),
              (shape.think >= 0, "think must be >= 0"))
    for ok, why in checks:
        if not ok:
            raise WorkloadError(f"bad workload {name!r}: {why}")
    return shape


# ============================================================================ building
def conversation_requests(shape: ConversationShape, rng: np.random.Generator, *, num_requests: int | None,
                          duration_s: float | None, rate: float, burstiness: float,
                          max_input_len: int | None = None, max_output_len: int | None = None) -> list[RequestSpec]:
    """The turns of the conversations, in order of their earliest arrival (module docstring)."""
    k = shape.conversations
    if duration_s is not None:
        starts = arrivals_within(rng, duration_s, rate, burstiness, k)
        cap = num_requests
    else:
        cap = num_requests if num_requests is not None else (None if k is not None else DEFAULT_TURNS)
        starts = gamma_arrivals(rng, k if k is not None else cap or DEFAULT_TURNS, rate, burstiness)
    next_id = shape.systems if shape.system else 0  # content ids: the system prompts first
    specs: list[RequestSpec] = []
    for c, start in enumerate(starts):
        if cap is not None and len(specs) >= cap:
            break
        n = shape.draw_turns(rng)
        users = lognormal_lengths(rng, n, shape.user, shape.user_sigma)
        answers = lognormal_lengths(rng, n, shape.answer, shape.answer_sigma)
        if max_output_len is not None:
            answers = np.minimum(answers, max_output_len)
        thinks = rng.exponential(shape.think, size=n) if shape.think > 0 else np.zeros(n)
        history = [Segment(int(rng.integers(shape.systems)), shape.system, "system")] if shape.system else []
        t, prev = float(start), None
        for j in range(n):
            if cap is not None and len(specs) >= cap:
                break
            base, ulen = sum(g.length for g in history), int(users[j])
            if max_input_len is not None and base + ulen > max_input_len:
                if j:
                    break  # the conversation outgrew the context: it ends here
                ulen = max_input_len - base
                if ulen < 1:
                    raise WorkloadError(f"the system prompt ({shape.system} tokens) leaves no room for a message "
                                        f"within --max-input-len {max_input_len}")
            user, answer = Segment(next_id, ulen, "user"), Segment(next_id + 1, int(answers[j]), "assistant")
            next_id += 2
            prompt = [*history, user]
            think = float(thinks[j]) if j else 0.0
            t += think
            specs.append(RequestSpec(t, base + ulen, answer.length, conversation=c, turn=j, after=prev,
                                     think_s=think, prompt_segments=prompt, answer_segments=[answer]))
            prev = len(specs) - 1
            history = [*prompt, answer]
    return in_arrival_order(specs)


def in_arrival_order(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """Sorted by (earliest) arrival, stably, with ``after`` pointing at the new positions (a turn
    comes after its predecessor: its arrival is not earlier, and it was listed later)."""
    order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)
    return _reindexed(specs, order)


def _reindexed(specs: Sequence[RequestSpec], order: Sequence[int]) -> list[RequestSpec]:
    where = {old: new for new, old in enumerate(order)}
    out = []
    for i in order:
        s = specs[i]
        if s.after is not None and s.after not in where:
            raise ValueError(f"turn {i} kept without its previous turn {s.after}")
        out.append(s if s.after is None else replace(s, after=where[s.after]))
    return out


def conversations_at_rate(specs: Sequence[RequestSpec], rate: float, duration_s: float | None) -> list[RequestSpec]:
    """The same conversations with their starts rescaled to ``rate`` a second (the pattern of gaps
    kept), each later turn's earliest arrival moved with its start; conversations that start at or
    after ``duration_s`` are left out whole."""
    roots = [i for i, s in enumerate(specs) if s.after is None]
    times = [0.0] * len(specs)
    for i, t in zip(roots, rescale_to_rate([specs[i].arrival_s for i in roots], rate), strict=True):
        times[i] = float(t)
    keep = [True] * len(specs)
    for i, s in enumerate(specs):  # a predecessor is listed first
        if s.after is not None:
            times[i], keep[i] = times[s.after] + s.think_s, keep[s.after]
        elif duration_s is not None:
            keep[i] = times[i] < duration_s
    moved = [replace(s, arrival_s=t) for s, t in zip(specs, times, strict=True)]
    kept = _reindexed(moved, [i for i in range(len(moved)) if keep[i]])
    return in_arrival_order(kept)


def successors(specs: Sequence[RequestSpec]) -> dict[int, int]:
    """Index of each turn's next turn (turns with none are absent)."""
    out: dict[int, int] = {}
    for i, s in enumerate(specs):
        if s.after is not None:
            if s.after in out:
                raise ValueError(f"turns {out[s.after]} and {i} both follow turn {s.after}")
            if not 0 <= s.after < i:
                raise ValueError(f"turn {i} follows turn {s.after}, which is not listed before it")
            out[s.after] = i
    return out


# ============================================================================ content
def _key(seed: int, content: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(content), 51])


def materialize_conversations(specs: Sequence[RequestSpec], maker: PromptMaker, prompt_format: str,
                              seed: int = 0) -> list[RequestSpec]:
    """Give each turn ``contents``: the token ids (``ids``) or text (``text``) of exactly each
    segment's length, for the system prompts and user messages it is the first turn to send. The
    content of an id depends only on (seed, id), so equal ids are equal content, across
    conversations too (a shared system prompt). A first turn also gets its whole prompt
    (``prompt_token_ids`` or ``prompt_text``); later turns' prompts hold answers not known yet."""
    out = []
    for s in specs:
        if s.prompt_segments is None or s.answer_segments is None:
            raise WorkloadError("a conversation workload cannot be mixed with other requests")
        sent: set[int] = set()
        if s.after is not None:
            prev = specs[s.after]
            sent = {g.content for g in (*(prev.prompt_segments or ()), *(prev.answer_segments or ()))}
        contents: dict[int, Any] = {}
        for g in s.prompt_segments:
            if g.content in sent or g.role == "assistant":
                continue
            rng = _key(seed, g.content)
            contents[g.content] = (maker.random_ids(g.length, rng) if prompt_format == "ids"
                                   else maker.plain_text(g.length, rng))
        first: dict[str, Any] = {}
        if s.after is None:
            if prompt_format == "ids":
                first["prompt_token_ids"] = prompt_ids(s, contents)
            else:
                first["prompt_text"] = prompt_text(s, contents)
        out.append(replace(s, contents=contents, **first))
    return out


def prompt_ids(spec: RequestSpec, known: Mapping[int, Sequence[int]]) -> list[int]:
    """A turn's prompt as token ids: its segments' contents one after the other."""
    return [t for g in spec.prompt_segments or () for t in known[g.content]]


TEXT_SEPARATOR = "\n"


def prompt_text(spec: RequestSpec, known: Mapping[int, str]) -> str:
    """A turn's prompt as one text (the completions endpoint): its segments' texts, a line each."""
    return TEXT_SEPARATOR.join(known[g.content] for g in spec.prompt_segments or ())


def chat_messages(spec: RequestSpec, known: Mapping[int, str]) -> list[dict[str, str]]:
    """A turn's prompt as chat messages: one per segment, in its role."""
    return [{"role": g.role, "content": known[g.content]} for g in spec.prompt_segments or ()]


__all__ = ["ConversationShape", "DEFAULT_TURNS", "chat_messages", "conversation_requests", "conversations_at_rate",
           "in_arrival_order", "is_conversation", "materialize_conversations", "parse_conversation", "prompt_ids",
           "prompt_text", "successors"]
