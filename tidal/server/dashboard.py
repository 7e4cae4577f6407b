"""The live page: ``GET /dashboard`` (HTML and a small canvas chart script shipped in the package)
and ``GET /admin/latency``, the recent TTFT and inter-token latency in time buckets.

The page polls ``/admin/state`` (KV use, running and waiting, the policy's caps and buckets, per
instance with several), ``/admin/latency`` and, on a server that splits requests,
``/admin/splits``. Nothing is loaded from elsewhere: clusters often have no internet.

The latency series are fed by the same observations as the Prometheus histograms
(``tidal:time_to_first_token_seconds``, ``tidal:inter_token_latency_seconds``,
``tidal:e2e_request_latency_seconds``): :func:`install` wraps those histograms so that each
observation also lands in a :class:`RecentLatency` bucket, without touching how they are fed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query, Response
from fastapi.responses import HTMLResponse, JSONResponse

from tidal.server.errors import APIError
from tidal.server.openapi import errors, json_object

BUCKET_S = 5.0
WINDOW_S = 900.0  # the longest history kept (15 minutes)
STATIC = ("dashboard.html", "dashboard.js", "chart.js")


class _Bucket:
    __slots__ = ("e2e_n", "itl_max", "itl_n", "itl_sum", "start", "ttft_max", "ttft_n", "ttft_sum")

    def __init__(self, start: float):
        self.start = start
        self.ttft_n = self.itl_n = self.e2e_n = 0
        self.ttft_sum = self.itl_sum = self.ttft_max = self.itl_max = 0.0

    def to_dict(self) -> dict[str, Any]:
        def mean(s: float, n: int) -> float | None:
            return s / n if n else None

        return {"t": self.start, "requests": self.e2e_n, "first_tokens": self.ttft_n, "tokens": self.itl_n,
                "ttft_mean_s": mean(self.ttft_sum, self.ttft_n), "ttft_max_s": self.ttft_max if self.ttft_n else None,
                "itl_mean_s": mean(self.itl_sum, self.itl_n), "itl_max_s": self.itl_max if self.itl_n else None}


class RecentLatency:
    """TTFT, inter-token gaps and finished requests in ``bucket_s`` buckets of wall-clock time
    (Unix seconds, so the page can label its axis), the last ``window_s`` kept."""

    def __init__(self, bucket_s: float = BUCKET_S, window_s: float = WINDOW_S, clock: Any = time.time):
        self.bucket_s = bucket_s
        self.buckets: deque[_Bucket] = deque(maxlen=max(1, int(window_s / bucket_s)))
        self.clock = clock
        self.totals = {"requests": 0, "first_tokens": 0, "tokens": 0}
        self._lock = threading.Lock()

    def _current(self) -> _Bucket:
        start = self.clock() // self.bucket_s * self.bucket_s
        if not self.buckets or self.buckets[-1].start != start:
            self.buckets.append(_Bucket(start))
        return self.buckets[-1]

    def ttft(self, seconds: float) -> None:
        with self._lock:
            b = self._current()
            b.ttft_n += 1
            b.ttft_sum += seconds
            b.ttft_max = max(b.ttft_max, seconds)
            self.totals["first_tokens"] += 1

    def itl(self, seconds: float) -> None:
        with self._lock:
            b = self._current()
            b.itl_n += 1
            b.itl_sum += seconds
            b.itl_max = max(b.itl_max, seconds)
            self.totals["tokens"] += 1

    def finished(self, seconds: float) -> None:
        with self._lock:
            self._current().e2e_n += 1
            self.totals["requests"] += 1

    def series(self, window_s: float) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            rows = [b.to_dict() for b in self.buckets if b.start > now - window_s - self.bucket_s]
            return {"now": now, "bucket_s": self.bucket_s, "window_s": window_s, "totals": dict(self.totals),
                    "buckets": rows}


class _Recorded:
    """A histogram child whose observations are also handed to ``record``."""

    def __init__(self, hist: Any, record: Any):
        self._hist, self._record = hist, record

    def observe(self, amount: float, *args: Any, **kwargs: Any) -> None:
        self._hist.observe(amount, *args, **kwargs)
        self._record(amount)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hist, name)


def _static(name: str) -> str:
    return resources.files("tidal.server").joinpath("static", name).read_text(encoding="utf-8")


def install(app: FastAPI, metrics: Any) -> RecentLatency:
    """Add ``/dashboard``, its scripts and ``/admin/latency`` to ``app``; feed the series from
    ``metrics`` (a :class:`tidal.server.metrics.ServerMetrics`)."""
    recent = RecentLatency()
    metrics.ttft = _Recorded(metrics.ttft, recent.ttft)
    metrics.itl = _Recorded(metrics.itl, recent.itl)
    metrics.e2e = _Recorded(metrics.e2e, recent.finished)
    app.state.recent_latency = recent
    files = {name: _static(name) for name in STATIC}  # read once: a missing file fails at start-up

    @app.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(files["dashboard.html"], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_file(name: str) -> Response:
        if name not in files or not name.endswith(".js"):
            return APIError(f"no such file: /dashboard/{name}", 404, code="not_found").response()
        return Response(files[name], media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    @app.get("/admin/latency", responses={**json_object("Recent TTFT, inter-token latency and finished requests"),
                                          **errors(400)})
    async def admin_latency(window: float = Query(600.0, gt=0, le=WINDOW_S)) -> JSONResponse:
        """TTFT, inter-token latency and finished requests per ``bucket_s`` over the last ``window`` s."""
        return JSONResponse(recent.series(window))

    return recent


__all__ = ["BUCKET_S", "WINDOW_S", "RecentLatency", "install"]
