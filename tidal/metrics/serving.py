"""Serving metrics, defined once: used by ``tidal bench serve`` and by the simulator.

Pure: no torch, no threads, no sockets and no clock -- every time is an argument, in seconds
relative to the start of a run (t = 0 is the first scheduled arrival).

Per request (:class:`RequestRecord`):

* **TTFT**: send -> first token (first chunk that carries a token). The client sends each request
  at its scheduled arrival unless ``--max-concurrency`` holds it back; the wait for a slot is
  recorded apart (``queue_s``) and is not part of TTFT.
* **ITL** (inter-token latency, TBT): the gaps between consecutive tokens. A chunk that carries
  ``k > 1`` tokens has its gap split evenly into ``k`` gaps of ``gap / k`` (tokens of the first
  chunk beyond the first get gaps of 0), so a request has ``output_tokens - 1`` gaps that sum to
  ``last token - first token`` (see :func:`itl_from_chunks`).
* **TPOT**: ``(e2e - ttft) / (output_tokens - 1)``; undefined (None) with fewer than 2 tokens.
* **E2E**: send -> end of the response.

Over a run (:func:`summarize`): completed and failed counts, request and token throughput over
the run's duration, and ``mean``/``std``/``min``/``p50``/``p90``/``p99``/``max`` of TTFT, TPOT
(one value per request), ITL (all gaps of all requests pooled) and E2E, in milliseconds.
Percentiles interpolate linearly between order statistics (numpy's default).

**SLO attainment**: the share of *all* requests (failed ones included) that attain; a request
attains when it succeeded and meets every SLO given (TTFT, TPOT, E2E; a request with one output
token has no TPOT and meets a TPOT SLO). With no SLO, attaining = succeeding.
**Goodput**: attaining requests per second, and their output tokens per second.
**Cached prompt share**: over the completed requests whose server reported its prefix cache
(``usage.prompt_tokens_details.cached_tokens``), the share of their prompt tokens it had cached
(None when none reported it).
**Capacity**: the highest request rate whose attainment is at least a target
(:class:`CapacitySearch` bisects on rate; the caller runs the probes).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


# ============================================================================ per request
@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the start of the run."""

    index: int
    arrival_s: float  # scheduled arrival
    prompt_len: int  # requested prompt length (tokens)
    output_len: int  # requested output length (max_tokens)
    send_s: float | None = None  # when the HTTP request went out (None: never sent)
    end_s: float | None = None  # when the response ended (or failed)
    success: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server's usage, when it reports it
    output_tokens: int = 0  # from usage when reported, else the counted tokens
    counted_tokens: int = 0  # tokens counted in the stream's chunks
    num_chunks: int = 0
    status: int | None = None  # HTTP status
    error: str = ""
    response_id: str | None = None  # the response's ``id`` (the server's request id)
    placement: dict[str, Any] | None = None  # where a cluster ran it (e.g. DynaServe's split), if it says
    # prompt tokens the server's prefix cache had (usage.prompt_tokens_details.cached_tokens; None: not reported)
    cached_tokens: int | None = None

    @property
    def queue_s(self) -> float | None:
        return None if self.send_s is None else max(0.0, self.send_s - self.arrival_s)

    @property
    def tpot_s(self) -> float | None:
        return tpot(self)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        d["queue_s"] = self.queue_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def tpot(rec: RequestRecord) -> float | None:
    """Time per output token after the first: ``(e2e - ttft) / (output_tokens - 1)``."""
    if not rec.success or rec.ttft_s is None or rec.e2e_s is None or rec.output_tokens < 2:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)


def itl_from_chunks(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token gaps from chunk arrival times and the tokens each chunk carries.

    Chunk ``i > 0`` arrives ``g = times[i] - times[i-1]`` after the previous one; its ``k`` tokens
    get ``k`` gaps of ``g / k``. The first chunk's extra tokens (beyond its first) get gaps of 0.
    Chunks with 0 tokens must be left out by the caller.
    """
    if len(times) != len(counts):
        raise ValueError("times and counts differ in length")
    gaps: list[float] = []
    for i, (t, k) in enumerate(zip(times, counts, strict=True)):
        if k <= 0:
            raise ValueError("a chunk in the list carries no tokens")
        if i == 0:
            gaps.extend([0.0] * (k - 1))
        else:
            g = t - times[i - 1]
            gaps.extend([g / k] * k)
    return gaps


# ============================================================================ SLOs
class SLOError(ValueError):
    pass


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None = not given."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    tbt_s: float | None = None  # the 99th percentile of a request's own gaps between tokens (DynaServe Sec. 6)

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None and self.tbt_s is None

    def to_ms(self) -> dict[str, float]:
        out = {}
        for key, v in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s), ("tbt", self.tbt_s)):
            if v is not None:
                out[key] = v * 1000.0
        return out

    def describe(self) -> str:
        return ", ".join(f"{k} <= {v:g} ms" for k, v in self.to_ms().items()) or "none"


_SLO_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s", "e2el": "e2e_s", "tbt": "tbt_s"}
_SLO_ITEM = re.compile(r"\s*([a-zA-Z0-9]+)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(ms|s)?\s*")


def parse_slo(text: str | None) -> SLO:
    """``"ttft=2000,tpot=200,e2e=30000"`` (milliseconds; a value may end in ``ms`` or ``s``)."""
    if text is None or not text.strip():
        return SLO()
    vals: dict[str, float] = {}
    for item in text.split(","):
        m = _SLO_ITEM.fullmatch(item)
        if not m:
            raise SLOError(f"bad --slo item {item.strip()!r}: expected NAME=MILLISECONDS, e.g. ttft=2000,tpot=200")
        key = m.group(1).lower()
        if key not in _SLO_KEYS:
            raise SLOError(f"unknown SLO {m.group(1)!r} in --slo (use ttft, tpot, e2e, tbt)")
        v = float(m.group(2)) * (1.0 if m.group(3) == "s" else 1e-3)
        if not v > 0:
            raise SLOError(f"SLO {key} must be > 0")
        if _SLO_KEYS[key] in vals:
            raise SLOError(f"SLO {key} given twice in --slo")
        vals[_SLO_KEYS[key]] = v
    return SLO(**vals)


def slo_checks(rec: RequestRecord, slo: SLO) -> dict[str, bool]:
    """Which of the given SLOs the request meets (a failed request meets none)."""
    out: dict[str, bool] = {}
    ok = rec.success
    if slo.ttft_s is not None:
        out["ttft"] = ok and rec.ttft_s is not None and rec.ttft_s <= slo.ttft_s
    if slo.tpot_s is not None:
        t = tpot(rec)
        out["tpot"] = ok and (t is None or t <= slo.tpot_s)
    if slo.e2e_s is not None:
        out["e2e"] = ok and rec.e2e_s is not None and rec.e2e_s <= slo.e2e_s
    if slo.tbt_s is not None:
        out["tbt"] = ok and (not rec.itl_s or float(np.percentile(rec.itl_s, 99)) <= slo.tbt_s)
    return out


def attains(rec: RequestRecord, slo: SLO) -> bool:
    """Succeeded and met every SLO given."""
    return rec.success and all(slo_checks(rec, slo).values())


# ============================================================================ summaries
def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean, std, min, p50, p90, p99, max (times ``scale``) of the values; Nones when empty."""
    a = np.asarray([v for v in values if v is not None], dtype=float) * scale
    keys = ["mean", "std", "min", *(f"p{p}" for p in PERCENTILES), "max"]
    if a.size == 0:
        return {k: None for k in keys} | {"count": 0}
    out: dict[str, float | None] = {"mean": float(a.mean()), "std": float(a.std()), "min": float(a.min())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(a.max())
    out["count"] = int(a.size)
    return out


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    """From t = 0 to the last response's end (0 when nothing ended)."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return max(ends) if ends else 0.0


def _rate(x: float, duration_s: float) -> float | None:
    return x / duration_s if duration_s > 0 else None


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None, slo: SLO | None = None
              ) -> dict[str, Any]:
    """The run's summary (see the module docstring for the definitions)."""
    slo = slo or SLO()
    dur = benchmark_duration(records) if duration_s is None else duration_s
    ok = [r for r in records if r.success]
    n = len(records)
    in_tok = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    good = [r for r in ok if attains(r, slo)]
    per_slo: dict[str, float | None] = {}
    for key in slo.to_ms():
        met = sum(1 for r in records if slo_checks(r, slo).get(key))
        per_slo[key] = met / n if n else None
    errors = Counter(r.error for r in records if not r.success)
    told = [r for r in ok if r.cached_tokens is not None]  # the server reported its prefix cache's share
    told_prompt = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in told)
    cached = sum(r.cached_tokens or 0 for r in told)
    return {
        "num_requests": n,
        "completed": len(ok),
        "failed": n - len(ok),
        "duration_s": dur,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": _rate(len(ok), dur),
        "input_throughput": _rate(in_tok, dur),
        "output_throughput": _rate(out_tok, dur),
        "total_token_throughput": _rate(in_tok + out_tok, dur),
        "ttft_ms": distribution((r.ttft_s for r in ok), 1000.0),
        "tpot_ms": distribution((tpot(r) for r in ok), 1000.0),
        "itl_ms": distribution((g for r in ok for g in r.itl_s), 1000.0),
        "e2el_ms": distribution((r.e2e_s for r in ok), 1000.0),
        "queue_ms": distribution((r.queue_s for r in records if r.send_s is not None), 1000.0),
        "slo": slo.to_ms(),
        "slo_attainment": len(good) / n if n else None,
        "slo_attainment_by_metric": per_slo,
        "attained": len(good),
        "goodput": {
            "request_throughput": _rate(len(good), dur),
            "output_throughput": _rate(sum(r.output_tokens for r in good), dur),
        },
        "errors": dict(errors.most_common(10)),
        "cached_prompt_tokens": cached if told else None,
        "cached_prompt_share": cached / told_prompt if told and told_prompt else None,
    }


def in_flight_series(records: Sequence[RequestRecord]) -> tuple[list[float], list[int]]:
    """Step function of requests in flight (sent, not ended): times and the count from each time on."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.send_s is None:
            continue
        events.append((r.send_s, 1))
        if r.end_s is not None:
            events.append((r.end_s, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    times, counts, cur = [0.0], [0], 0
    for t, d in events:
        cur += d
        if times and times[-1] == t:
            counts[-1] = cur
        else:
            times.append(t)
            counts.append(cur)
    return times, counts


__all__ = [
    "PERCENTILES", "SLO", "RequestRecord", "SLOError", "attains", "benchmark_duration", "distribution",
    "in_flight_series", "itl_from_chunks", "parse_slo", "slo_checks", "summarize", "tpot",
]
