"""A workload's unit: :class:`RequestSpec`, and the content spans of conversation turns (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Segment:
    """A span of content in a prompt or an answer: ``length`` tokens of content ``content``. Equal
    content ids are equal tokens (one system prompt shared by conversations, a turn's answer resent
    in the next turn's history), so two requests share a prefix exactly where their spans are equal.
    ``role`` is the chat role the span is sent as: ``system``, ``user`` or ``assistant``."""

    content: int
    length: int
    role: str = "user"


@dataclass
class RequestSpec:
    """One request of a workload. ``arrival_s`` counts from the start of the run.

    A turn of a conversation (:mod:`tidal.workload.conversation`) also has: ``after``, the index
    of its previous turn's spec, and ``think_s``: it is sent ``think_s`` after that turn's response
    ended (a closed loop; its ``arrival_s`` is only the earliest it can be: its conversation's start
    plus the think times before it); ``prompt_segments`` and ``answer_segments``, what its prompt
    and its answer hold; ``contents``, the materialized text or token ids of the segments it is
    the first turn to send (system prompt, user message; an answer is what the server returned)."""

    arrival_s: float
    prompt_len: int
    output_len: int
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    #: Mooncake prefix-block hashes (requests sharing a hash share that 512-token block)
    hash_ids: list[int] | None = None
    conversation: int | None = None
    turn: int = 0
    after: int | None = None
    think_s: float = 0.0
    prompt_segments: list[Segment] | None = None
    answer_segments: list[Segment] | None = None
    contents: dict[int, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"arrival_s": self.arrival_s, "prompt_len": self.prompt_len,
                             "output_len": self.output_len}
        if self.conversation is not None:
            d.update(conversation=self.conversation, turn=self.turn, after=self.after, think_s=self.think_s)
        return d
