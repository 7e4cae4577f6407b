"""The load client of ``tidal bench serve``: streams requests to an OpenAI-compatible server.

Every request goes out at its scheduled arrival (asyncio timers on ``time.perf_counter``), as
``POST {base}/v1/completions`` or ``/v1/chat/completions`` with ``stream: true``,
``stream_options.include_usage``, ``max_tokens`` = the output length and ``ignore_eos: true`` so the
server produces exactly that many tokens (vLLM, tidal and llama.cpp honour it).

Token counting in the SSE stream: a chunk carries as many tokens as it lists in ``token_ids`` or
in its logprobs when the server sends them; otherwise one token when it has text (completions:
also an empty-text chunk without a finish reason, which servers send for a token whose text is
held back; chat: only non-empty ``content``). The final usage chunk gives the exact output and
prompt token counts (``output_tokens``); the chunk timing gives TTFT and the gaps (see
:mod:`tidal.metrics` for how a multi-token chunk's gap is split).

The run is bounded: by the number of requests, by ``time_limit_s`` (no request is sent after it;
requests still running ``drain_s`` later are cancelled and count as failed), and by a per-request
timeout. Only ``base_url`` is contacted; proxies from the environment are ignored.

The server's ``usage.prompt_tokens_details.cached_tokens`` (its prefix cache's hit) is recorded
per request when it reports one.

Conversations (:mod:`tidal.workload.conversation`) run as a closed loop, one chain per
conversation: its first turn goes out at the conversation's arrival, each later turn ``think_s``
after the previous turn's response ended, with the whole history: chat messages (system, user,
then each answer as the assistant's message, as the server returned its text); or, with token-id
prompts on the completions endpoint, the previous prompt's ids + the answer's ids + the new
message's (``return_token_ids``, vLLM's field, asks the server for the answer's ids; a server
that sends none has the answer's text encoded with the tokenizer); or one text. When a turn fails
the rest of its conversation is not sent and counts as failed (no answer to go on from); a turn due
after ``time_limit_s`` is not sent and not counted, like any request due then.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from tidal.metrics import RequestRecord, itl_from_chunks
from tidal.workload import RequestSpec
from tidal.workload.conversation import chat_messages, prompt_ids, prompt_text, successors

DROPPED = "not sent: an earlier turn of its conversation failed"


class BenchError(Exception):
    """A problem the user must fix (unreachable server, bad URL...); the message says which."""


def normalize_base_url(url: str) -> str:
    u = url.strip().rstrip("/")
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"bad --base-url {url!r}: expected http://HOST:PORT")
    if u.endswith("/v1"):
        u = u[:-3]
    return u


def _session(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False)


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return " ".join(body.split())[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        if "detail" in obj:
            return str(obj["detail"])[:300]
        return str(err)[:300]
    return str(obj)[:300]


async def _get_models(base_url: str, timeout_s: float) -> list[str]:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
    async with _session(timeout) as s:
        try:
            async with s.get(f"{base_url}/v1/models") as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise BenchError(f"GET {base_url}/v1/models returned HTTP {resp.status}: "
                                     f"{_error_message(body)}; pass --model")
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, ConnectionRefusedError):
                why = "connection refused (is the server running?)"
            else:
                why = (e.os_error.strerror if e.os_error is not None else None) or str(e)
            raise BenchError(f"cannot connect to {base_url}: {why}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise BenchError(f"cannot reach {base_url}: {type(e).__name__} {e}".strip()) from None
    try:
        data = json.loads(body)
        return [str(m["id"]) for m in data.get("data", [])]
    except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise BenchError(f"GET {base_url}/v1/models did not return an OpenAI model list") from None


def check_server(base_url: str, timeout_s: float = 5.0) -> list[str]:
    """Quick connect check; returns the served model ids (BenchError when unreachable)."""
    return asyncio.run(_get_models(base_url, timeout_s))


# ============================================================================ one request
@dataclass
class ClientOptions:
    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    ignore_eos: bool = True
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    time_limit_s: float | None = None
    drain_s: float = 60.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None  # encodes an answer's text when a server returns no token ids (conversations)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url + path


def build_payload(spec: RequestSpec, opts: ClientOptions, prompt: Any = None) -> dict[str, Any]:
    """The request body; ``prompt`` (a conversation turn's history: chat messages, token ids or
    text) replaces the spec's own prompt."""
    body: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": int(spec.output_len),
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        text = spec.prompt_text
        if prompt is not None:
            body["messages"] = prompt
        elif text is None:
            raise BenchError("the chat endpoint needs text prompts (use --prompt-format text)")
        else:
            body["messages"] = [{"role": "user", "content": text}]
    elif prompt is not None:
        body["prompt"] = prompt
        if isinstance(prompt, list):  # the next turn sends this answer's ids
            body["return_token_ids"] = True
    else:
        body["prompt"] = spec.prompt_token_ids if spec.prompt_token_ids is not None else (spec.prompt_text or "")
    body.update(opts.extra_body)
    return body


def chunk_tokens(choice: dict[str, Any], chat: bool) -> int:
    """Tokens one streamed choice carries (see the module docstring)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        return len(ids)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        seq = lp.get("content") if chat else lp.get("tokens")
        if isinstance(seq, list) and seq:
            return len(seq)
    if chat:
        delta = choice.get("delta") or {}
        return 1 if (delta.get("content") or delta.get("reasoning_content")) else 0
    if choice.get("text"):
        return 1
    return 1 if choice.get("finish_reason") is None and "text" in choice else 0


@dataclass
class Answer:
    """What a response streamed: its text and, where the server listed them, its token ids."""

    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def add(self, choice: dict[str, Any], chat: bool) -> None:
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if isinstance(piece, str):
            self.text.append(piece)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            self.ids.extend(int(t) for t in ids if isinstance(t, int))

    def token_ids(self, num_tokens: int, tokenizer: Any) -> list[int]:
        """The answer's ids: as the server listed them when it listed all ``num_tokens``, else its
        text encoded (BenchError without a tokenizer)."""
        if len(self.ids) == num_tokens:
            return list(self.ids)
        if tokenizer is None:
            raise BenchError("the server returned no token ids for an answer and no tokenizer was given")
        return list(tokenizer.encode("".join(self.text), add_special_tokens=False))


async def send_one(session: aiohttp.ClientSession, spec: RequestSpec, opts: ClientOptions, rec: RequestRecord,
                   t0: float, prompt: Any = None, answer: Answer | None = None) -> None:
    """Stream one request; fills ``rec`` as it goes (so a cancelled request keeps what it got), and
    ``answer`` with what the response said."""
    chat = opts.endpoint == "chat"
    payload = build_payload(spec, opts, prompt)
    times: list[float] = []
    counts: list[int] = []
    usage: dict[str, Any] | None = None
    finished = False
    send = time.perf_counter()
    rec.send_s = send - t0
    try:
        async with session.post(opts.url, json=payload) as resp:
            rec.status = resp.status
            if resp.status != 200:
                body = await resp.text()
                rec.error = f"HTTP {resp.status}: {_error_message(body)}"
                return
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload_bytes = line[5:].strip()
                    if payload_bytes == b"[DONE]":
                        finished = True
                        continue
                    try:
                        obj = json.loads(payload_bytes)
                    except json.JSONDecodeError:
                        rec.error = f"malformed SSE data: {payload_bytes[:120]!r}"
                        return
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj:
                        rec.error = f"stream error: {_error_message(json.dumps(obj))}"
                        return
                    if obj.get("usage"):
                        usage = obj["usage"]
                    if rec.response_id is None and isinstance(obj.get("id"), str):
                        rec.response_id = obj["id"]
                    k = 0
                    for c in obj.get("choices") or []:
                        if isinstance(c, dict):
                            k += chunk_tokens(c, chat)
                            if answer is not None:
                                answer.add(c, chat)
                    rec.num_chunks += 1
                    if k:
                        if not times:
                            rec.ttft_s = now - send
                        times.append(now)
                        counts.append(k)
                        rec.counted_tokens += k
                        rec.output_tokens = rec.counted_tokens
            end = time.perf_counter()
    except asyncio.TimeoutError:
        rec.error = f"timeout after {opts.request_timeout_s:g} s"
        return
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
        return
    finally:
        if rec.end_s is None:
            rec.end_s = time.perf_counter() - t0
        rec.itl_s = itl_from_chunks(times, counts) if times else []
    if usage:
        if isinstance(usage.get("completion_tokens"), int):
            rec.output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]
    if not times:
        rec.error = "no tokens received"
        return
    if not finished and usage is None:
        rec.error = "stream ended without [DONE]"
        return
    rec.end_s = end - t0
    rec.e2e_s = end - send
    rec.success = True


# ============================================================================ a run
def _history(spec: RequestSpec, known: dict[int, Any], opts: ClientOptions, ids: bool) -> Any:
    """A conversation turn's prompt from the contents known so far (module docstring)."""
    if opts.endpoint == "chat":
        if ids:
            raise BenchError("the chat endpoint needs text prompts (use --prompt-format text)")
        return chat_messages(spec, known)
    return prompt_ids(spec, known) if ids else prompt_text(spec, known)


async def run_load(specs: Sequence[RequestSpec], opts: ClientOptions,
                   on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send ``specs`` at their arrival times (a conversation's later turns: ``think_s`` after the
    previous turn ended); returns the records of the requests sent or dropped (in spec order) and
    the duration (t=0 to the last end, or to the time limit plus drain)."""
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s, sock_connect=10)
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    records = [RequestRecord(i, s.arrival_s, s.prompt_len, s.output_len) for i, s in enumerate(specs)]
    following = successors(specs)
    current: dict[asyncio.Task, RequestRecord] = {}  # each chain's request in flight (or next)
    sent: list[RequestRecord] = []
    async with _session(timeout) as session:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, rec: RequestRecord, prompt: Any, answer: Answer | None) -> None:
            if sem is not None:
                async with sem:
                    if opts.time_limit_s is not None and time.perf_counter() - t0 >= opts.time_limit_s:
                        rec.error = "not sent: time limit reached while waiting for a concurrency slot"
                        return
                    await send_one(session, spec, opts, rec, t0, prompt, answer)
            else:
                await send_one(session, spec, opts, rec, t0, prompt, answer)

        async def chain(i: int) -> None:
            """Request ``i``, then (a conversation) each next turn after its think time."""
            task = asyncio.current_task()
            assert task is not None
            known: dict[int, Any] = {}
            ids = specs[i].prompt_token_ids is not None
            while True:
                spec, rec = specs[i], records[i]
                current[task] = rec
                prompt, answer = None, None
                if spec.prompt_segments is not None:
                    known.update(spec.contents or {})
                    prompt, answer = _history(spec, known, opts, ids), Answer()
                try:
                    await one(spec, rec, prompt, answer)
                except BenchError:
                    raise  # the user's to fix (e.g. the chat endpoint without text): the run stops
                except Exception as e:  # anything else fails this request only, with its name
                    rec.success, rec.error = False, f"{type(e).__name__}: {e}"[:300]
                if on_done is not None:
                    on_done(rec)
                j = following.get(i)
                if j is None:
                    return
                if rec.success and answer is not None and spec.answer_segments:
                    try:
                        known[spec.answer_segments[0].content] = (answer.token_ids(rec.output_tokens, opts.tokenizer)
                                                                  if ids else "".join(answer.text))
                    except BenchError as e:
                        rec.success, rec.error = False, str(e)
                if not rec.success:
                    while j is not None:
                        records[j].error = DROPPED
                        sent.append(records[j])
                        if on_done is not None:
                            on_done(records[j])
                        j = following.get(j)
                    return
                arrival = (rec.end_s or 0.0) + specs[j].think_s
                if opts.time_limit_s is not None and arrival >= opts.time_limit_s:
                    return  # due after the time limit: not sent, like any request due then
                records[j].arrival_s = arrival
                delay = t0 + arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent.append(records[j])
                i = j

        for spec, rec in zip(specs, records, strict=True):
            if spec.after is not None:
                continue  # sent by its conversation's chain
            if opts.time_limit_s is not None and spec.arrival_s >= opts.time_limit_s:
                break
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(chain(rec.index))
            current[task] = rec
            sent.append(rec)
        deadline = None
        if opts.time_limit_s is not None:
            deadline = t0 + opts.time_limit_s + opts.drain_s
        pending: set[asyncio.Task] = set(current)
        if pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.perf_counter())
            done, pending = await asyncio.wait(pending, timeout=wait_s)
            for task in done:
                task.result()  # a chain's own error (a bug, or BenchError from a bad payload) surfaces
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            now = time.perf_counter() - t0
            for task in pending:
                rec = current[task]
                rec.success = False
                rec.error = "cancelled: still running at the time limit"
                if rec.end_s is None or rec.end_s > now:
                    rec.end_s = now
                if on_done is not None:
                    on_done(rec)
    ends = [r.end_s for r in sent if r.end_s is not None]
    duration = max(ends) if ends else 0.0
    return sorted(sent, key=lambda r: r.index), duration


def run(specs: Sequence[RequestSpec], opts: ClientOptions,
        on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_load(specs, opts, on_done))


__all__ = ["DROPPED", "Answer", "BenchError", "ClientOptions", "build_payload", "check_server", "chunk_tokens", "normalize_base_url",
           "run", "run_load", "send_one"]
