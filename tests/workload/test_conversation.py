"""The conversation workload: turns that resend the history, named content, closed-loop timing,
and block names from content spans that share exactly where the engine's hashes of the tokens do."""

from __future__ import annotations

import numpy as np
import pytest

from tidal import workload as W
from tidal.core.block_hash import block_hashes, span_block_names, trace_block_names
from tidal.workload.conversation import (
    chat_messages,
    conversations_at_rate,
    parse_conversation,
    prompt_ids,
    prompt_text,
    successors,
)


class FakeTok:
    """Whitespace words as tokens: token ``id`` is its three base-26 letters."""

    vocab_size = 500

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(w[0]) - 97) * 676 + (ord(w[1]) - 97) * 26 + ord(w[2]) - 97 for w in text.split()]

    def decode(self, ids) -> str:
        return "".join(" " + chr(97 + i // 676) + chr(97 + i // 26 % 26) + chr(97 + i % 26) for i in ids)


def _make(name: str, **kw) -> list[W.RequestSpec]:
    return W.make_requests(W.WorkloadOptions(workload=name, **kw))


def test_each_turn_resends_the_history_and_a_new_message():
    specs = _make("conversation:system=50,turns=2-5,think=3", num_requests=60, rate=2.0, seed=4)
    assert len(specs) == 60
    nxt = successors(specs)
    assert nxt, "some conversation has two turns"
    for i, s in enumerate(specs):
        assert s.prompt_len == sum(g.length for g in s.prompt_segments)
        assert [g.length for g in s.answer_segments] == [s.output_len]
        assert s.prompt_segments[0].role == "system" and s.prompt_segments[0].length == 50
        assert s.prompt_segments[-1].role == "user"
        if s.after is None:
            assert s.turn == 0 and len(s.prompt_segments) == 2 and s.think_s == 0
            continue
        p = specs[s.after]
        assert s.after < i and s.conversation == p.conversation and s.turn == p.turn + 1
        # turn k + 1's prompt = turn k's prompt + its answer + one new message, span for span
        assert s.prompt_segments[:-1] == [*p.prompt_segments, *p.answer_segments]
        assert s.prompt_segments[-1].content not in {g.content for g in p.prompt_segments}
        assert s.arrival_s == pytest.approx(p.arrival_s + s.think_s) and s.think_s > 0
    # every user message and answer has its own content id; the system prompt is shared
    owned = [g.content for s in specs for g in (s.prompt_segments[-1], *s.answer_segments)]
    assert len(owned) == len(set(owned))
    assert {s.prompt_segments[0].content for s in specs} == {0}
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    last = max(s.conversation for s in specs)  # the one the cap of 60 turns may cut short
    turns = [sum(1 for t in specs if t.conversation == c) for c in range(last)]
    assert all(2 <= n <= 5 for n in turns) and len(set(turns)) > 1


def test_counts_caps_and_starts():
    specs = _make("conversation:conversations=7,turns=3,think=0", rate=1.0, seed=1)
    assert len(specs) == 21 and len({s.conversation for s in specs}) == 7
    starts = sorted(s.arrival_s for s in specs if s.after is None)
    assert starts[0] == 0.0 and len(starts) == 7
    assert all(s.arrival_s == specs[s.after].arrival_s for s in specs if s.after is not None)  # think 0
    # --num-requests caps the turns of all conversations together
    assert len(_make("conversation:conversations=7,turns=3", num_requests=10, rate=1.0)) == 10
    # --max-input-len ends a conversation before the turn that would not fit; --max-output-len caps answers
    capped = _make("conversation:turns=8,user=200,answer=300", num_requests=80, rate=1.0, max_input_len=1500,
                   max_output_len=100, seed=2)
    assert max(s.prompt_len for s in capped) <= 1500 and max(s.output_len for s in capped) <= 100
    assert max(s.turn for s in capped) < 7
    # --duration bounds the starts; a geometric number of turns by default
    timed = _make("conversation", duration_s=20.0, rate=0.5, seed=3)
    assert all(s.arrival_s < 20.0 for s in timed if s.after is None)
    assert len(timed) > len([s for s in timed if s.after is None])


@pytest.mark.parametrize("bad", ["conversation:turns=0", "conversation:turns=3,turns_mean=2", "conversation:foo=1",
                                 "conversation:user=abc", "conversation:think=-1", "conversation:systems=0",
                                 "conversation:system", "conversation:turns=2,turns=3", "conversational"])
def test_bad_conversation_names(bad):
    with pytest.raises(W.WorkloadError):
        _make(bad, num_requests=5)


def test_defaults_parse():
    shape = parse_conversation("conversation")
    assert shape.turns is None and shape.turns_mean == 4 and shape.system == 0
    assert parse_conversation("conversation:turns=2-6").turns == (2, 6)


def test_rescaled_starts_keep_the_conversations():
    base = _make("conversation:turns=3,think=2", num_requests=30, rate=1.0, seed=5)
    fast = conversations_at_rate(base, 4.0, None)
    assert len(fast) == len(base)
    starts = sorted(s.arrival_s for s in fast if s.after is None)
    assert (len(starts) - 1) / (starts[-1] - starts[0]) == pytest.approx(4.0)
    for s in fast:
        if s.after is not None:
            p = fast[s.after]
            assert s.conversation == p.conversation and s.arrival_s == pytest.approx(p.arrival_s + s.think_s)
    cut = W.specs_at_rate(base, 4.0, 1.0)  # whole conversations that start before 1 s
    kept = {s.conversation for s in cut}
    assert kept and all(c in kept for c in {s.conversation for s in cut if s.after is not None})
    assert len(cut) == sum(1 for s in base if s.conversation in kept)
    successors(cut)  # well formed


def test_materialized_content_is_equal_where_ids_are():
    specs = _make("conversation:system=20,turns=3,user=12,answer=9", num_requests=12, rate=1.0, seed=6)
    tok = FakeTok()
    mat = W.materialize(specs, tok, "ids", seed=3)
    first = [s for s in mat if s.after is None]
    assert all(s.prompt_token_ids == s.contents[0] + s.contents[s.prompt_segments[1].content] for s in first)
    assert all(len(v) == {g.content: g.length for g in s.prompt_segments}[k] for s in mat for k, v in s.contents.items())
    assert all(s.contents[0] == first[0].contents[0] for s in first)  # one system prompt for all
    # a later turn's prompt, with the answers a server returned, is the previous prompt + answer + message
    known: dict[int, list[int]] = {}
    by_conv: dict[int, list[int]] = {}
    for s in mat:
        known.update(s.contents)
        ids = prompt_ids(s, known)
        assert len(ids) == s.prompt_len
        if s.after is not None:
            prev = by_conv[s.conversation]
            answer = known[mat[s.after].answer_segments[0].content]
            assert ids == prev + answer + s.contents[s.prompt_segments[-1].content]
        by_conv[s.conversation] = ids
        known[s.answer_segments[0].content] = list(range(300, 300 + s.output_len))  # "the server's answer"
    text = W.materialize(specs, tok, "text", seed=3)
    t0 = text[0]
    assert [len(tok.encode(v)) for v in t0.contents.values()] == [g.length for g in t0.prompt_segments]
    msgs = chat_messages(t0, t0.contents)
    assert [m["role"] for m in msgs] == ["system", "user"] and prompt_text(t0, t0.contents) == t0.prompt_text


def _old_trace_block_names(hash_ids, trace_block, prompt_len, block_size, unique):
    """main's trace_block_names before spans (the reference the general version must equal)."""
    from tidal.core.block_hash import hash_block

    names: list[bytes] = []
    covered = len(hash_ids) * trace_block
    for j in range(prompt_len // block_size):
        start, end = j * block_size, (j + 1) * block_size
        parent = names[-1] if names else None
        if end <= covered:
            spans, t = [], start
            while t < end:
                k, off = divmod(t, trace_block)
                n = min(end - t, trace_block - off)
                spans += [hash_ids[k], off, n]
                t += n
            names.append(hash_block(parent, spans, b"trace"))
        else:
            names.append(b"own|%b|%d" % (unique, j))
    return names


def test_trace_names_are_unchanged():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tb, bs = int(rng.choice([512, 16, 7, 100])), int(rng.choice([16, 32, 7, 512, 1000]))
        ids = [int(x) for x in rng.integers(0, 30, size=int(rng.integers(0, 8)))]
        n = int(rng.integers(1, len(ids) * tb + 600))
        assert trace_block_names(ids, tb, n, bs, b"u") == _old_trace_block_names(ids, tb, n, bs, b"u")


@pytest.mark.parametrize("block_size", [16, 7, 64])
def test_span_names_share_exactly_where_the_engine_hashes_do(block_size):
    """Expand every content id to tokens of its own and hash them as the engine does: two requests'
    block names are equal at a position exactly where the engine's hashes are."""
    specs = _make("conversation:system=40,systems=2,turns=4,user=30,answer=25", num_requests=40, rate=1.0, seed=7)
    rng = np.random.default_rng(1)
    tokens: dict[int, list[int]] = {}
    rows = []
    for k, s in enumerate(specs):
        segs = [*s.prompt_segments, *s.answer_segments]
        for g in segs:
            tokens.setdefault(g.content, [int(x) for x in rng.integers(0, 50000, size=g.length)])
        toks = [t for g in segs for t in tokens[g.content]]
        names = span_block_names([(g.content, g.length) for g in segs], len(toks), block_size, str(k).encode())
        rows.append((names, block_hashes(toks, block_size)))
    shared = 0
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            (na, ha), (nb, hb) = rows[a], rows[b]
            for j in range(min(len(na), len(nb))):
                assert (na[j] == nb[j]) == (ha[j] == hb[j])
                shared += na[j] == nb[j]
    assert shared > 50  # turns of a conversation, and conversations with one system prompt
