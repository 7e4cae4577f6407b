"""Benchmark workloads: request lengths, arrival times and prompts (shared with the simulator).

This module is pure: no torch, no threads, no sockets and no clock. Randomness comes from a
seeded ``numpy.random.Generator``, files are read only when a path is given, and a tokenizer (any
object with ``encode(text, add_special_tokens=True) -> list[int]``, ``decode(ids) -> str`` and
``vocab_size``) is passed in by the caller when prompts need one.

A workload is a list of :class:`RequestSpec` (arrival time in seconds from the start, prompt
length, output length, and later the prompt itself). Building one has two steps:

1. :func:`make_requests` -- lengths and arrivals only (what the simulator needs);
2. :func:`materialize` -- prompts of exactly those lengths for a tokenizer: random token ids
   (``ids``) or text that re-encodes to the exact length (``text``).

Workload names (``--workload``):

* ``fixed:IN:OUT`` and ``uniform:INMIN-INMAX:OUTMIN-OUTMAX`` (integers, bounds inclusive);
* ``mix:NAME=WEIGHT,NAME=WEIGHT,...``: each request draws one of those synthetic workloads with
  probability proportional to its weight (e.g. ``mix:alpaca=0.8,longbench=0.2``, BucketServe's
  "Mixed" of Alpaca and LongBench, Sec. II-B, whose proportions the paper does not give);
* named shapes from the papers (:data:`SHAPES`): lognormal lengths with the published means
  (the lognormal ``mu`` is ``ln(mean) - sigma**2 / 2``, so the mean before rounding and clipping is
  exact), or fixed lengths when sigma is 0;
* ``alpaca-real``: the real instruction texts of ``alpaca_en_demo.json`` (instruction, a blank line,
  then the input when there is one); the output length is the token count of the dataset's answer;
* ``sharegpt-lengths`` / ``arxiv-lengths``: rows of the length sets, sampled with the seed
  (without replacement while there are enough rows);
* ``trace``: the rows of a timed trace file (:func:`load_trace`: Azure CSV or Mooncake JSONL), in
  time order, with their own arrival times;
* ``conversation[:KEY=VALUE,...]``: multi-turn conversations whose turns resend the history, each
  turn sent a think time after the previous one ended (:mod:`tidal.workload.conversation`).

Arrivals of the untimed workloads: a Gamma process of rate ``R`` and burstiness ``B`` (gaps are
Gamma with shape ``B`` and scale ``1 / (R * B)``, mean ``1/R``, coefficient of variation
``1/sqrt(B)``): ``B = 1`` is Poisson, ``B < 1`` is burstier. ``R = inf`` sends everything at t=0.
The first request arrives at t=0; request ``i`` at the sum of the first ``i`` gaps.

Trace timing: ``time_scale`` is a *speedup* -- arrival ``t`` becomes ``t / time_scale`` (2 replays
twice as fast, 0.5 at half speed). Or ``rate`` rescales the replayed window so its average rate
``(n - 1) / (t_last - t_first)`` is ``rate`` req/s, keeping the relative pattern of the gaps.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from tidal.workload.spec import RequestSpec, Segment  # noqa: F401  (re-exported)
from tidal.workload.traces import (  # noqa: F401  (re-exported)
    TraceRow,
    WorkloadError,
    detect_trace_format,
    load_alpaca,
    load_length_set,
    load_trace,
    parse_azure_timestamp,
)

TRACE_FILES = {
    "azure": "azure2023_conv.csv",
    "mooncake": "mooncake_synthetic.jsonl",
    "sharegpt-lengths": "sharegpt_8k_lengths.csv",
    "arxiv-lengths": "arxiv_summarization_lengths.csv",
    "alpaca-real": "alpaca_en_demo.json",
}
MOONCAKE_BLOCK_TOKENS = 512  # tokens behind one hash id of the Mooncake trace
MAX_SHAPE_LEN = 131072  # lognormal samples are clipped to [1, this]


class TokenizerLike(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# ============================================================================ length shapes
@dataclass(frozen=True)
class Shape:
    """Lognormal (or fixed, sigma 0) input and output lengths with the given means."""

    in_mean: float
    out_mean: float
    in_sigma: float = 0.0
    out_sigma: float = 0.0
    burstiness: float | None = None  # default arrival burstiness of this shape (None: Poisson)
    note: str = ""


SHAPES: dict[str, Shape] = {
    "alpaca": Shape(83, 128, 0.6, 0.8, note="Alpaca-like short prompts (BucketServe: mean input 83)"),
    "longbench": Shape(5900, 499, 0.5, 0.6, note="LongBench-like long prompts (5.9K in / 499 out)"),
    "sharegpt": Shape(1660, 373, 1.0, 0.9, note="ShareGPT conversations (1,660 / 373)"),
    "burstgpt": Shape(642, 262, 0.9, 0.9, burstiness=0.5,
                      note="BurstGPT (642 / 262); bursty arrivals (Gamma burstiness 0.5) unless --burstiness"),
    "dynaserve-8192-32": Shape(8192, 32, note="DynaServe prefill-heavy shape, fixed 8192 / 32"),
    "dynaserve-2048-512": Shape(2048, 512, note="DynaServe balanced shape, fixed 2048 / 512"),
    "dynaserve-219-1467": Shape(219, 1467, note="DynaServe decode-heavy shape, fixed 219 / 1467"),
    "azure-code": Shape(2048, 28, 0.8, 0.9, note="Azure Code 2023, prefill heavy (about 2,048 in / 28 out)"),
    # DynaServe's hybrid (Table 2): goodput / capacity is 64-69 tokens a request for all three systems
    # (316 / 4.6, 399 / 5.9, 474 / 7.4), so with Azure Code's 28 its BurstGPT half averages ~104 out
    "burstgpt-dynaserve": Shape(642, 104, 0.9, 0.9, burstiness=0.5,
                                note="BurstGPT prompts (642) with the outputs DynaServe's hybrid implies (104: "
                                     "Table 2's goodput / capacity, 64-69 tokens a request, with Azure Code's 28)"),
}
LENGTH_SETS = ("sharegpt-lengths", "arxiv-lengths")
WORKLOAD_NAMES = (*SHAPES, "alpaca-real", *LENGTH_SETS, "trace", "fixed:IN:OUT", "uniform:A-B:C-D",
                  "mix:NAME=W,NAME=W", "conversation[:KEY=VALUE,...]")


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    """``n`` integer lengths >= 1 whose distribution is lognormal with the given mean (fixed if sigma=0)."""
    if sigma <= 0:
        return np.full(n, max(1, int(round(mean))), dtype=np.int64)
    mu = math.log(mean) - sigma * sigma / 2
    x = rng.lognormal(mu, sigma, size=n)
    return np.clip(np.rint(x), 1, MAX_SHAPE_LEN).astype(np.int64)


def _parse_range(text: str, what: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not m:
        raise WorkloadError(f"bad {what} range {text!r} (expected N or MIN-MAX)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if lo < 1 or hi < lo:
        raise WorkloadError(f"bad {what} range {text!r} (need 1 <= MIN <= MAX)")
    return lo, hi


def synthetic_lengths(name: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths of ``n`` requests of a synthetic workload (a shape, fixed or uniform)."""
    if name in SHAPES:
        s = SHAPES[name]
        return lognormal_lengths(rng, n, s.in_mean, s.in_sigma), lognormal_lengths(rng, n, s.out_mean, s.out_sigma)
    kind, _, rest = name.partition(":")
    if kind == "mix":
        return _mixed_lengths(name, rest, n, rng)
    parts = rest.split(":")
    if kind in ("fixed", "uniform") and len(parts) == 2:
        (ilo, ihi), (olo, ohi) = _parse_range(parts[0], "input"), _parse_range(parts[1], "output")
        if kind == "fixed" and (ilo != ihi or olo != ohi):
            raise WorkloadError(f"bad workload {name!r}: fixed takes fixed:IN:OUT")
        ins = rng.integers(ilo, ihi + 1, size=n)
        outs = rng.integers(olo, ohi + 1, size=n)
        return ins.astype(np.int64), outs.astype(np.int64)
    raise WorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOAD_NAMES)}")


def _mixed_lengths(name: str, rest: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    parts: list[tuple[str, float]] = []
    for item in rest.split(","):
        comp, sep, w = item.strip().rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = -1.0
        if not sep or not comp or not weight >= 0 or comp.startswith("mix:"):
            raise WorkloadError(f"bad workload {name!r}: mix takes mix:NAME=WEIGHT,NAME=WEIGHT,... of synthetic "
                                f"workloads with weights >= 0")
        parts.append((comp, weight))
    total = sum(w for _, w in parts)
    if not total > 0:
        raise WorkloadError(f"bad workload {name!r}: the weights sum to 0")
    pick = rng.choice(len(parts), size=n, p=[w / total for _, w in parts])
    ins, outs = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    for j, (comp, _) in enumerate(parts):
        sel = pick == j
        ins[sel], outs[sel] = synthetic_lengths(comp, int(sel.sum()), rng)
    return ins, outs


# ============================================================================ arrivals
def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Arrival times of ``n`` requests: first at 0, then Gamma gaps (shape B, scale 1/(R*B))."""
    if n <= 0:
        return np.zeros(0)
    if burstiness <= 0:
        raise WorkloadError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def arrivals_within(rng: np.random.Generator, duration_s: float, rate: float, burstiness: float = 1.0,
                    max_requests: int | None = None) -> np.ndarray:
    """Gamma-process arrivals in ``[0, duration_s)`` (at most ``max_requests``)."""
    if math.isinf(rate):
        raise WorkloadError("--duration needs a finite --rate (or --num-requests)")
    cap = max_requests if max_requests is not None else 10_000_000
    out: list[np.ndarray] = []
    t, total = 0.0, 0
    first = True
    while total < cap:
        k = max(16, int(rate * duration_s * 1.2) + 16)
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=k)
        if first:
            gaps[0] = 0.0
            first = False
        times = t + np.cumsum(gaps)
        keep = times[times < duration_s]
        out.append(keep)
        total += len(keep)
        if len(keep) < k:
            break
        t = float(times[-1])
    arr = np.concatenate(out) if out else np.zeros(0)
    return arr[:cap]


def rescale_to_rate(arrivals: Sequence[float], rate: float) -> np.ndarray:
    """Shift to start at 0 and stretch so the average rate ``(n-1)/span`` is ``rate``; the pattern of
    gaps is kept. ``rate = inf`` sends everything at 0."""
    a = np.asarray(arrivals, dtype=float)
    if len(a) == 0:
        return a
    a = a - a.min()
    if math.isinf(rate):
        return np.zeros_like(a)
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    span = float(a.max())
    if len(a) < 2 or span <= 0:
        return a
    return a * ((len(a) - 1) / (rate * span))


def speed_up(arrivals: Sequence[float], time_scale: float) -> np.ndarray:
    """Replay ``time_scale`` times faster: ``t -> t / time_scale`` (after shifting to start at 0)."""
    if not time_scale > 0 or math.isinf(time_scale):
        raise WorkloadError(f"--time-scale must be a positive number, got {time_scale}")
    a = np.asarray(arrivals, dtype=float)
    if len(a) == 0:
        return a
    return (a - a.min()) / time_scale


def mean_rate(arrivals: Sequence[float]) -> float | None:
    """Average rate ``(n - 1) / span`` of arrival times (None with fewer than 2 or zero span)."""
    a = np.asarray(arrivals, dtype=float)
    if len(a) < 2 or a.max() <= a.min():
        return None
    return (len(a) - 1) / float(a.max() - a.min())


def cv_of_gaps(arrivals: Sequence[float]) -> float:
    """Coefficient of variation of inter-arrival gaps (1 for Poisson)."""
    gaps = np.diff(np.sort(np.asarray(arrivals, dtype=float)))
    return float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else 0.0


def _approx_tokens(text: str) -> int:
    """Rough token count without a tokenizer (about 4/3 tokens per word)."""
    return max(1, round(len(text.split()) * 4 / 3))


# ============================================================================ building a workload
@dataclass
class WorkloadOptions:
    workload: str | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    rate: float | None = None  # None: inf for synthetic arrivals, the trace's own times for a trace
    burstiness: float | None = None
    seed: int = 0
    trace: str | None = None
    time_scale: float | None = None
    dataset: str | None = None  # file of alpaca-real / *-lengths (default: the shared traces dir)
    traces_dir: str | None = None
    max_input_len: int | None = None
    max_output_len: int | None = None


def default_traces_dir() -> str:
    """``../shared/traces`` beside the project root (the folder holding the ``tidal`` package),
    else relative to the working directory."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cand = os.path.join(os.path.dirname(root), "shared", "traces")
    return cand if os.path.isdir(cand) else os.path.join("..", "shared", "traces")


def default_dataset_path(workload: str, traces_dir: str | None) -> str:
    return os.path.join(traces_dir or default_traces_dir(), TRACE_FILES[workload])


def specs_at_rate(base: Sequence[RequestSpec], rate: float, duration_s: float | None) -> list[RequestSpec]:
    """The same requests with arrivals rescaled to average ``rate`` (cut at ``duration_s``);
    conversations: their starts (:func:`tidal.workload.conversation.conversations_at_rate`)."""
    if any(s.after is not None for s in base):
        from tidal.workload.conversation import conversations_at_rate

        return conversations_at_rate(base, rate, duration_s)
    arr = rescale_to_rate([s.arrival_s for s in base], rate)
    out = [replace(s, arrival_s=float(t)) for s, t in zip(base, arr, strict=True)]
    if duration_s is not None:
        out = [s for s in out if s.arrival_s < duration_s]
    return out


def window_at_rate(base: Sequence[RequestSpec], rate: float, duration_s: float | None) -> list[RequestSpec]:
    """A trace window whose mean rate is ``rate``: the first ``floor(rate x duration_s) + 1``
    requests of ``base`` (fewer when it runs out), rescaled so that their mean rate ``(n-1)/span``
    is exactly ``rate`` (the pattern of their gaps kept), so they span at most ``duration_s``.
    Rescaling the whole trace and cutting it at ``duration_s`` instead gives the window the mean
    rate of whatever part of the trace lands in it, not ``rate``. No ``duration_s``: the whole
    trace at ``rate`` (:func:`specs_at_rate`)."""
    if duration_s is None or math.isinf(rate):
        return specs_at_rate(base, rate, duration_s)
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    k = min(len(base), int(math.floor(rate * duration_s)) + 1)
    return specs_at_rate(list(base)[:k], rate, None)


def make_requests(opts: WorkloadOptions, tokenizer: TokenizerLike | None = None) -> list[RequestSpec]:
    """Lengths and arrivals (prompts only for ``alpaca-real``), sorted by arrival."""
    n, dur = opts.num_requests, opts.duration_s
    if n is not None and n < 1:
        raise WorkloadError("--num-requests must be >= 1")
    if dur is not None and not dur > 0:
        raise WorkloadError("--duration must be > 0")
    rng = np.random.default_rng(opts.seed)
    name = opts.workload or ("trace" if opts.trace else None)
    if name is None:
        raise WorkloadError("give --workload or --trace")
    if opts.trace and name != "trace":
        raise WorkloadError(f"--trace replays a trace file; it cannot be combined with --workload {name}")
    if name == "trace":
        if not opts.trace:
            raise WorkloadError("--workload trace needs --trace PATH")
        specs = _trace_requests(opts)
    elif name == "conversation" or name.startswith("conversation:"):
        from tidal.workload import conversation as C

        if opts.time_scale is not None:
            raise WorkloadError("--time-scale applies to --trace replay only")
        return C.conversation_requests(C.parse_conversation(name), rng, num_requests=n, duration_s=dur,
                                       rate=math.inf if opts.rate is None else opts.rate,
                                       burstiness=1.0 if opts.burstiness is None else opts.burstiness,
                                       max_input_len=opts.max_input_len, max_output_len=opts.max_output_len)
    else:
        if opts.time_scale is not None:
            raise WorkloadError("--time-scale applies to --trace replay only")
        burst = opts.burstiness if opts.burstiness is not None else (
            SHAPES[name].burstiness if name in SHAPES and SHAPES[name].burstiness else 1.0)
        rate = math.inf if opts.rate is None else opts.rate
        if dur is not None:
            arrivals = arrivals_within(rng, dur, rate, burst, n)
        else:
            arrivals = gamma_arrivals(rng, n if n is not None else 100, rate, burst)
        k = len(arrivals)
        texts: list[str | None] = [None] * k
        if name == "alpaca-real":
            pairs = load_alpaca(opts.dataset or default_dataset_path(name, opts.traces_dir))
            idx = _sample_indices(rng, len(pairs), k)
            texts = [pairs[i][0] for i in idx]
            if tokenizer is not None:
                ins = [len(tokenizer.encode(pairs[i][0])) for i in idx]
                outs = [max(1, len(tokenizer.encode(pairs[i][1], add_special_tokens=False))) for i in idx]
            else:
                ins = [_approx_tokens(pairs[i][0]) for i in idx]
                outs = [_approx_tokens(pairs[i][1]) for i in idx]
        elif name in LENGTH_SETS:
            all_in, all_out = load_length_set(opts.dataset or default_dataset_path(name, opts.traces_dir))
            idx = _sample_indices(rng, len(all_in), k)
            ins, outs = all_in[idx].tolist(), all_out[idx].tolist()
        else:
            a, b = synthetic_lengths(name, k, rng)
            ins, outs = a.tolist(), b.tolist()
        specs = [RequestSpec(float(t), int(i), max(1, int(o)), prompt_text=txt)
                 for t, i, o, txt in zip(arrivals, ins, outs, texts, strict=True)]
    return clip_lengths(specs, opts.max_input_len, opts.max_output_len)


def _sample_indices(rng: np.random.Generator, population: int, k: int) -> np.ndarray:
    return rng.choice(population, size=k, replace=k > population)


def _trace_requests(opts: WorkloadOptions) -> list[RequestSpec]:
    if opts.rate is not None and not math.isinf(opts.rate) and opts.time_scale is not None:
        raise WorkloadError("give either --rate or --time-scale for a trace, not both")
    if opts.burstiness is not None:
        raise WorkloadError("--burstiness applies to synthetic arrivals; a trace keeps its own times")
    path = opts.trace or ""
    if not os.path.exists(path):
        raise WorkloadError(f"trace file not found: {path}")
    rows = load_trace(path, limit=None)
    if opts.num_requests is not None:
        rows = rows[:opts.num_requests]
    times = np.asarray([r.time_s for r in rows])
    if opts.rate is not None and not math.isinf(opts.rate):
        arr = rescale_to_rate(times, opts.rate)
    else:
        arr = speed_up(times, opts.time_scale if opts.time_scale is not None else 1.0)
    specs = [RequestSpec(float(t), r.input_len, max(1, r.output_len), hash_ids=r.hash_ids)
             for t, r in zip(arr, rows, strict=True)]
    if opts.duration_s is not None:
        specs = [s for s in specs if s.arrival_s < opts.duration_s]
    if not specs:
        raise WorkloadError(f"{path}: no trace rows fall inside --duration {opts.duration_s}")
    return specs


def clip_lengths(specs: list[RequestSpec], max_input_len: int | None, max_output_len: int | None
                 ) -> list[RequestSpec]:
    """Cap prompt and output lengths (for small models); a clipped text prompt is cut later."""
    out = []
    for s in specs:
        p = min(s.prompt_len, max_input_len) if max_input_len else s.prompt_len
        o = min(s.output_len, max_output_len) if max_output_len else s.output_len
        out.append(replace(s, prompt_len=max(1, p), output_len=max(1, o)))
    return out


def length_stats(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    ins = np.asarray([s.prompt_len for s in specs], dtype=float)
    outs = np.asarray([s.output_len for s in specs], dtype=float)
    arr = [s.arrival_s for s in specs]
    r = mean_rate(arr)
    return {
        "num_requests": len(specs),
        "input_mean": float(ins.mean()) if len(ins) else None,
        "input_max": int(ins.max()) if len(ins) else None,
        "output_mean": float(outs.mean()) if len(outs) else None,
        "output_max": int(outs.max()) if len(outs) else None,
        "span_s": float(max(arr) - min(arr)) if arr else 0.0,
        "mean_rate": r,
        "gap_cv": cv_of_gaps(arr) if len(arr) > 2 else None,
        **({"conversations": len({s.conversation for s in specs}),  # and their starts' rate (the arrivals
            "start_rate": mean_rate([s.arrival_s for s in specs if s.after is None])}  # of later turns: earliest)
           if specs and specs[0].conversation is not None else {}),
    }


# ============================================================================ prompts
_FALLBACK_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
                   "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but",
                   "have", "an", "had", "they", "you", "were", "their", "one", "all", "we", "can")
_WORD_RE = re.compile(r" [a-z]{3,10}")


class PromptMaker:
    """Makes prompts of exact token lengths for one tokenizer (or approximate ones with none)."""

    def __init__(self, tokenizer: TokenizerLike | None, seed: int = 0, special_ids: Sequence[int] = ()):
        self.tok = tokenizer
        self.rng = np.random.default_rng(seed + 7919)
        self.special = {int(i) for i in special_ids}
        self._words: np.ndarray | None = None
        self._overhead: int | None = None
        self._blocks: dict[int, list[int]] = {}

    # -- token ids
    def random_ids(self, n: int, rng: np.random.Generator | None = None) -> list[int]:
        if self.tok is None:
            raise WorkloadError("token-id prompts need a tokenizer (--tokenizer)")
        rng = rng or self.rng
        ids = rng.integers(0, self.tok.vocab_size, size=n)
        if self.special:
            bad = np.isin(ids, list(self.special))
            while bad.any():
                ids[bad] = rng.integers(0, self.tok.vocab_size, size=int(bad.sum()))
                bad = np.isin(ids, list(self.special))
        return [int(i) for i in ids]

    def block_ids(self, hash_ids: Sequence[int], n: int) -> list[int]:
        """Token ids built from Mooncake prefix blocks: equal hash ids give equal 512-token blocks."""
        out: list[int] = []
        for h in hash_ids:
            if len(out) >= n:
                break
            if h not in self._blocks:
                self._blocks[h] = self.random_ids(MOONCAKE_BLOCK_TOKENS, np.random.default_rng([int(h), 1]))
            out.extend(self._blocks[h])
        if len(out) < n:
            out.extend(self.random_ids(n - len(out)))
        return out[:n]

    # -- text
    def _word_pool(self) -> np.ndarray:
        if self._words is None:
            assert self.tok is not None
            cand = self.rng.permutation(self.tok.vocab_size)
            words: list[int] = []
            for tid in cand[:20000]:
                tid = int(tid)
                if tid in self.special:
                    continue
                s = self.tok.decode([tid])
                if _WORD_RE.fullmatch(s) and self.tok.encode(s, add_special_tokens=False) == [tid]:
                    words.append(tid)
                    if len(words) >= 1024:
                        break
            if len(words) < 16:
                raise WorkloadError("the tokenizer has too few plain word tokens for text prompts; use "
                                    "--prompt-format ids")
            self._words = np.asarray(words)
        return self._words

    def special_overhead(self) -> int:
        """Tokens the tokenizer adds to a text (BOS...), counted like the server counts a prompt."""
        if self._overhead is None:
            assert self.tok is not None
            s = " hello world"
            self._overhead = max(0, len(self.tok.encode(s)) - len(self.tok.encode(s, add_special_tokens=False)))
        return self._overhead

    def exact_text(self, length: int, max_iters: int = 12) -> str:
        """Text that encodes (with the tokenizer's special tokens) to ``length`` tokens when possible:
        decode random word tokens, re-encode, then trim or pad and repeat until the count matches."""
        if self.tok is None:
            return self.approx_text(length)
        return self._text_of(max(1, length - self.special_overhead()), self.rng, max_iters)

    def plain_text(self, length: int, rng: np.random.Generator | None = None) -> str:
        """Text of ``length`` tokens without the tokenizer's special tokens (a message inside a
        longer prompt), drawn from ``rng``; approximate without a tokenizer."""
        rng = rng or self.rng
        return self.approx_text(length, rng) if self.tok is None else self._text_of(max(1, length), rng)

    def _text_of(self, target: int, rng: np.random.Generator, max_iters: int = 12) -> str:
        assert self.tok is not None
        words = self._word_pool()
        text = self.tok.decode(rng.choice(words, size=target).tolist()).lstrip()
        for _ in range(max_iters):
            ids = self.tok.encode(text, add_special_tokens=False)
            if len(ids) == target:
                return text
            if len(ids) > target:
                text = self.tok.decode(ids[:target])
            else:
                text += self.tok.decode(rng.choice(words, size=target - len(ids)).tolist())
        return text

    def approx_text(self, length: int, rng: np.random.Generator | None = None) -> str:
        """Without a tokenizer: common English words, about one token each."""
        idx = (rng or self.rng).integers(0, len(_FALLBACK_WORDS), size=max(1, length))
        return " ".join(_FALLBACK_WORDS[i] for i in idx)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text)) if self.tok is not None else len(text.split())

    def truncate_text(self, text: str, length: int) -> str:
        if self.tok is None:
            return " ".join(text.split()[:length])
        ids = self.tok.encode(text, add_special_tokens=False)
        target = max(1, length - self.special_overhead())
        return text if len(ids) <= target else self.tok.decode(ids[:target])


def materialize(specs: Sequence[RequestSpec], tokenizer: TokenizerLike | None, prompt_format: str = "ids",
                seed: int = 0, special_ids: Sequence[int] = ()) -> list[RequestSpec]:
    """Give every spec a prompt. ``ids``: random token ids (never special ones) of exactly
    ``prompt_len``, with Mooncake hash blocks shared between requests; ``text``: text that
    re-encodes to ``prompt_len`` tokens (approximate without a tokenizer). Specs that already have
    a text (``alpaca-real``) keep it, cut to ``prompt_len``. ``prompt_len`` is set to the real
    count when a tokenizer is given."""
    if prompt_format not in ("ids", "text"):
        raise WorkloadError(f"unknown prompt format {prompt_format!r} (ids or text)")
    maker = PromptMaker(tokenizer, seed, special_ids)
    if any(s.prompt_segments is not None for s in specs):
        from tidal.workload.conversation import materialize_conversations

        return materialize_conversations(specs, maker, prompt_format, seed)
    out = []
    for s in specs:
        if s.prompt_text is not None:
            text = maker.truncate_text(s.prompt_text, s.prompt_len)
            n = maker.count(text) if tokenizer is not None else s.prompt_len
            out.append(replace(s, prompt_text=text, prompt_len=n))
        elif prompt_format == "ids":
            ids = maker.block_ids(s.hash_ids, s.prompt_len) if s.hash_ids else maker.random_ids(s.prompt_len)
            out.append(replace(s, prompt_token_ids=ids))
        else:
            text = maker.exact_text(s.prompt_len)
            n = maker.count(text) if tokenizer is not None else s.prompt_len
            out.append(replace(s, prompt_text=text, prompt_len=n))
    return out


__all__ = [
    "LENGTH_SETS", "SHAPES", "TRACE_FILES", "PromptMaker", "RequestSpec", "Shape", "TokenizerLike", "TraceRow",
    "WorkloadError", "WorkloadOptions", "arrivals_within", "clip_lengths", "cv_of_gaps", "detect_trace_format",
    "gamma_arrivals", "length_stats", "load_alpaca", "load_length_set", "load_trace", "lognormal_lengths",
    "make_requests", "materialize", "mean_rate", "parse_azure_timestamp", "rescale_to_rate", "speed_up",
    "synthetic_lengths", "WORKLOAD_NAMES", "MOONCAKE_BLOCK_TOKENS", "MAX_SHAPE_LEN", "default_dataset_path",
    "default_traces_dir", "specs_at_rate", "window_at_rate", "Segment",
]
