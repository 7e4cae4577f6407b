"""Prefix caching on this machine: TTFT of a prompt whose long prefix the server has seen, against
the same prompt on a server that recomputes every prompt, in one run.

Two ``tidal serve`` processes of the default model, one after the other (never sharing the cores):
``--enable-prefix-caching`` (the default) and ``--no-enable-prefix-caching``. Against each, every
repeat sends a request whose prompt is a shared prefix of ``--prefix-tokens`` tokens (a system
prompt) plus its own question, then ``--followers`` more requests with the same prefix and other
questions, one at a time, streaming one output token; TTFT is measured by the client (send to first
token). Before each repeat the cache is emptied (``POST /reset_prefix_cache``). The figures: median
TTFT of the first (cold) request and of the followers on each server, the followers' reported
``cached_tokens``, the server's ``tidal:prefix_cache_*`` counters, and the ratio cached / uncached
TTFT. Writes one JSON (``tidal bench report`` reads it). Usage::

    python benchmarks/prefix_cache.py [--prefix-tokens 1500] [--repeats 5] [--followers 3]
        [--output benchmarks/results/DATE-NN-NAME-prefix-cache.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import httpx

from tidal.common.results import write_figures
from tidal.experiments.server_proc import serve, stop

QUESTIONS = ["What is the capital of France?", "Name three prime numbers.", "How far is the Moon?",
             "Why is the sky blue?", "What does a compiler do?", "Who wrote Hamlet?"]


def prefix_text(tokenizer, n: int) -> str:
    """A system prompt of about ``n`` tokens (plain sentences, cut at the token count)."""
    base = ("You are a helpful assistant for a logistics company. Answer briefly, politely and precisely, "
            "citing the relevant policy section when you can. ")
    ids = tokenizer.encode(base * (n // 20 + 2), add_special_tokens=False)[:n]
    return tokenizer.decode(ids)


def ttft(client: httpx.Client, url: str, prompt: str) -> tuple[float, int]:
    """Send one streamed completion of one token; (seconds to its first token, cached_tokens)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, cached = None, -1
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[6:]).json()
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None, "no token came back"
    return first, cached


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    text = client.get(f"{url}/metrics").text
    out = {}
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        m = re.search(rf"^tidal:{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def measure(flags: list[str], prefix: str, repeats: int, followers: int, log) -> dict:
    proc, url, logfile = serve(flags, [])
    try:
        with httpx.Client(timeout=600, trust_env=False) as c:
            ttft(c, url, prefix + " " + QUESTIONS[0])  # warm-up (kernels, first-step costs)
            cold, warm, cached = [], [], []
            for r in range(repeats):
                c.post(f"{url}/reset_prefix_cache").raise_for_status()
                t, _ = ttft(c, url, prefix + " " + QUESTIONS[r % len(QUESTIONS)])
                cold.append(t)
                for k in range(followers):
                    t, n = ttft(c, url, prefix + " " + QUESTIONS[(r + k + 1) % len(QUESTIONS)])
                    warm.append(t)
                    cached.append(n)
                log(f"  {' '.join(flags) or 'defaults'}: repeat {r + 1}/{repeats}: cold {1000 * cold[-1]:.0f} ms, "
                    f"followers {', '.join(f'{1000 * x:.0f}' for x in warm[-followers:])} ms")
            metrics = counters(c, url)
    finally:
        stop(proc)
    return {"cold_s": cold, "followers_s": warm, "cached_tokens": cached, "metrics": metrics}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--followers", type=int, default=3)
    p.add_argument("--output", default="results/prefix_cache.json")
    args = p.parse_args()
    from tidal.engine.loader import load_checkpoint
    from tidal.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(load_checkpoint(None))
    prefix = prefix_text(tok, args.prefix_tokens)
    n_prefix = len(tok.encode(prefix))

    def log(msg: str) -> None:
        print(msg, flush=True)

    on = measure([], prefix, args.repeats, args.followers, log)
    off = measure(["--no-enable-prefix-caching"], prefix, args.repeats, args.followers, log)
    med = statistics.median
    ratio = med(on["followers_s"]) / med(off["followers_s"])
    figures = [
        ["prompt: shared prefix (tokens)", n_prefix],
        ["TTFT, first request (cache empty), ms, median", round(1000 * med(on["cold_s"]), 1)],
        ["TTFT, later requests with the prefix cached, ms, median", round(1000 * med(on["followers_s"]), 1)],
        ["TTFT, the same requests without prefix caching, ms, median", round(1000 * med(off["followers_s"]), 1)],
        ["TTFT cached / uncached", round(ratio, 3)],
        ["cached_tokens reported for the later requests, median", med(on["cached_tokens"])],
        ["tidal:prefix_cache_hits / queries (tokens), caching on",
         f"{on['metrics']['prefix_cache_hits']:.0f} / {on['metrics']['prefix_cache_queries']:.0f}"],
        ["tidal:prefix_cache_queries (tokens), caching off", f"{off['metrics']['prefix_cache_queries']:.0f}"],
    ]
    write_figures(args.output, "prefix caching: TTFT of a shared long prefix",
                  f"Prefix caching: TTFT with a {n_prefix}-token shared prefix, cached against recomputed",
                  "python benchmarks/prefix_cache.py", figures,
                  f"Default model, one request at a time, one output token, {args.repeats} repeats x "
                  f"{args.followers} followers; each repeat starts from an empty cache. TTFT measured by the client "
                  "(send to first streamed token).", {"on": on, "off": off})
    return 0


if __name__ == "__main__":
    sys.exit(main())
