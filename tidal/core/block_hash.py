"""Names of full KV blocks for prefix caching: a hash chained from the parent block's.

A block's name is a 128-bit BLAKE2b digest of (parent's name | the block's token ids | extra keys)
(vLLM v1's design: a block's KV depends on every token before it, so equal names mean equal KV).
Extra keys separate what token ids alone cannot: the request's ``cache_salt`` (tenants that must
not probe each other's prompts through TTFT) and, later, adapters. A cryptographic hash rather than
Python's ``hash``: names cross processes (workers, the front end's cache view), and a collision
(which a client could search for against a weak hash) would hand one request another's KV.

Pure: no torch, no clocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

BlockHash = bytes

_ROOT = b"tidal-kv-v1"  # the parent of a sequence's first block


def salt_key(cache_salt: str | None) -> bytes:
    """The extra key of a request's first block from its ``cache_salt`` (empty for none)."""
    return b"" if not cache_salt else b"salt:" + cache_salt.encode("utf-8")


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """One block's name from its parent's (None for the first block), its tokens and extra keys."""
    data = (_ROOT if parent is None else parent) + array("q", tokens).tobytes()
    if extra:
        data += b"|" + extra
    return hashlib.blake2b(data, digest_size=16).digest()


def extend_hashes(hashes: list[BlockHash], tokens_of: Callable[[int, int], Sequence[int]], num_tokens: int,
                  block_size: int, extra: bytes = b"") -> list[BlockHash]:
    """Append to ``hashes`` the names of the full blocks among the first ``num_tokens`` tokens that
    it does not name yet; ``tokens_of(start, end)`` gives the token ids of a span. ``extra`` goes
    into the first block's name, so it reaches every later one through the chain. Returns ``hashes``."""
    for i in range(len(hashes), num_tokens // block_size):
        start = i * block_size
        hashes.append(hash_block(hashes[i - 1] if i else None, tokens_of(start, start + block_size),
                                 b"" if i else extra))
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[BlockHash]:
    """The names of every full block of ``tokens``."""
    return extend_hashes([], lambda a, b: tokens[a:b], len(tokens), block_size, salt_key(cache_salt))


def span_block_names(spans: Sequence[tuple[int, int]], num_tokens: int, block_size: int, unique: bytes,
                     extra: bytes = b"content") -> list[BlockHash]:
    """Names of the full blocks of ``num_tokens`` tokens without the tokens: the sequence is made of
    content spans, (content id, length) one after the other, and a block is named by the
    (id, offset in the content, tokens) pieces it covers, chained as :func:`hash_block` chains.
    Equal spans give equal names exactly where the engine, given each id's tokens, would give
    equal names (the simulator's requests have no tokens). Tokens past the spans are the request's
    own (``unique``). ``extra`` keeps one namespace of ids (a trace's) apart from another's."""
    names: list[BlockHash] = []
    ends: list[int] = []
    covered = 0
    for _, n in spans:
        covered += n
        ends.append(covered)
    k = 0  # the span holding the current token
    for j in range(num_tokens // block_size):
        start, end = j * block_size, (j + 1) * block_size
        if end > covered:  # the request's own tokens: a name no other request has (no chain needed)
            names.append(b"own|%b|%d" % (unique, j))
            continue
        pieces: list[int] = []
        t = start
        while t < end:
            while ends[k] <= t:
                k += 1
            content, n = spans[k]
            off = t - (ends[k] - n)
            m = min(end - t, n - off)
            pieces += [content, off, m]
            t += m
        names.append(hash_block(names[-1] if names else None, pieces, extra))
    return names


def trace_block_names(hash_ids: Sequence[int], trace_block: int, prompt_len: int, block_size: int,
                      unique: bytes) -> list[BlockHash]:
    """Names of a prompt's full blocks from a trace's block hash ids (Mooncake: one id per
    ``trace_block`` tokens, equal ids for equal contents): :func:`span_block_names` of spans of
    ``trace_block`` tokens each."""
    return span_block_names([(h, trace_block) for h in hash_ids], prompt_len, block_size, unique, b"trace")
