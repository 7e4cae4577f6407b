"""Prometheus metrics, named like vLLM's with a ``tidal:`` prefix, on a registry of the app's own.

Request-level histograms and counters are fed by the handlers (through :class:`RequestTracker`,
timed with ``time.monotonic()``); the engine gauges are read from ``AsyncLLM.stats`` (a snapshot
the engine thread refreshes every step and when idle) by a custom collector, so they are fresh at
every scrape without the scrape touching the engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tidal.core.policy import PolicyState, state_gauges
from tidal.engine.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
LONG_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)
FINISH_REASONS = ("stop", "length", "abort")
REJECTED_STATUSES = (400, 500, 503)  # what a refused submission answers (tidal.server.errors.from_exception)
ARRIVAL_WINDOW_S = 10.0  # the cluster monitor's window of the arrival rate


def batch_size_cap(stats: dict[str, Any], default: int) -> int:
    """The current cap on running requests: what the scheduler last used, else the configured one."""
    cap = stats.get("batch_size_cap")
    return cap if isinstance(cap, int) else default


class _EngineCollector:
    """Gauges (and the preemption counter) from the engine's latest stats snapshot.

    Every family the Grafana dashboard (deploy/grafana/tidal.json) queries is exported in every
    server mode, from the first scrape: a single engine shows itself as instance 0 and its
    cluster-only counters (fail-overs, hand-offs, splits, KV moved) at 0, so a panel shows 0, not
    "no data". ``tidal:policy_state`` always carries the step caps the policy applied
    (``caps.max_num_seqs``, ``caps.token_budget``: the configured ones under the ``continuous``
    baseline, whose state has no other number), beside each policy's own numbers."""

    def __init__(self, llm: Any, model_name: str, arrival_rate: Any = None):
        self.llm = llm
        self.model_name = model_name
        self.arrival_rate = arrival_rate or (lambda: 0.0)  # a single engine's requests per second (10 s window)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], float(value))
        return g

    def collect(self) -> Iterable[Metric]:
        s = self.llm.stats
        cluster = s.get("cluster") if isinstance(s.get("cluster"), dict) else None
        sched = self.llm.engine.config.scheduler
        total = int(s.get("num_kv_blocks", 0))
        free = int(s.get("num_free_kv_blocks", 0))
        yield self._gauge("tidal:num_requests_running", "Requests running on the engine.",
                          s.get("num_requests_running", 0))
        yield self._gauge("tidal:num_requests_waiting", "Requests waiting (or swapped out).",
                          s.get("num_requests_waiting", 0))
        yield self._gauge("tidal:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).",
                          s.get("kv_cache_usage_perc", 0.0))
        yield self._gauge("tidal:num_kv_blocks_used", "KV blocks in use.", total - free)
        yield self._gauge("tidal:num_kv_blocks_total", "KV blocks in the pool.", total)
        cap = batch_size_cap(s, sched.max_num_seqs)
        yield self._gauge("tidal:batch_size_cap", "Current cap on running requests (a cluster: each instance's "
                          "configured one).", cap)
        budget = s.get("token_budget")
        yield self._gauge("tidal:token_budget", "Token budget the scheduler used for the last step (a cluster: "
                          "each instance's configured one).",
                          budget if isinstance(budget, int) else sched.max_num_batched_tokens)
        pre = CounterMetricFamily("tidal:num_preemptions", "Preemptions since start.", labels=["model_name"])
        pre.add_metric([self.model_name], float(s.get("num_preemptions", 0)))
        yield pre
        for name, key, doc in (
                ("prefix_cache_queries", "prefix_cache_queries",
                 "Prompt tokens looked up in the prefix cache (first admissions; recomputation is not a query)."),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache (pool or host tier)."),
                ("prefix_cache_host_hits", "prefix_cache_host_hits",
                 "Prompt tokens found in the prefix cache's host tier (loaded back)."),
                ("kv_reused_tokens", "kv_reused_tokens",
                 "Tokens of KV moved in (hand-offs, migrations) that the instance's prefix cache held: shared, not written.")):
            cnt = CounterMetricFamily(f"tidal:{name}", doc, labels=["model_name"])
            cnt.add_metric([self.model_name], float(s.get(key, 0)))
            yield cnt
        yield self._gauge("tidal:num_kv_blocks_cached", "Cached KV blocks nobody holds (free, and may yet be hit).",
                          s.get("num_cached_kv_blocks", 0))
        # by what they did: swapped out, or recomputed (recompute mode, or swap mode with a full host pool)
        swapped = float(s.get("num_swap_preemptions", 0))
        by_mode = CounterMetricFamily("tidal:preemptions", "Preemptions since start, by what they did (swap: the "
                                      "KV went to the host pool; recompute: it was dropped).",
                                      labels=["model_name", "mode"])
        by_mode.add_metric([self.model_name, "swap"], swapped)
        by_mode.add_metric([self.model_name, "recompute"], float(s.get("num_preemptions", 0)) - swapped)
        yield by_mode
        fallbacks = CounterMetricFamily("tidal:swap_fallbacks", "Preemptions that wanted to swap, found the host "
                                        "pool (--swap-space) full and recomputed.", labels=["model_name"])
        fallbacks.add_metric([self.model_name], float(s.get("num_swap_fallbacks", 0)))
        yield fallbacks
        yield self._policy(s, cluster)
        yield from self._instances(s, cluster)

    def _policy(self, s: dict[str, Any], cluster: dict[str, Any] | None) -> Metric:
        doc = "Numeric state of the scheduling policy: the step caps it applied and its own numbers."
        sched = self.llm.engine.config.scheduler
        if cluster is None:
            g = GaugeMetricFamily("tidal:policy_state", doc, labels=["model_name", "key"])
            budget = s.get("token_budget")
            g.add_metric([self.model_name, "caps.max_num_seqs"], float(batch_size_cap(s, sched.max_num_seqs)))
            g.add_metric([self.model_name, "caps.token_budget"],
                         float(budget if isinstance(budget, int) else sched.max_num_batched_tokens))
            policy = s.get("policy")
            if isinstance(policy, PolicyState):
                for key, val in policy.gauges():
                    g.add_metric([self.model_name, key], val)
            return g
        g = GaugeMetricFamily("tidal:policy_state", doc, labels=["model_name", "key", "instance"])
        for inst in cluster["instances"]:
            i = str(inst["index"])
            g.add_metric([self.model_name, "caps.max_num_seqs", i], float(inst.get("batch_size_cap") or sched.max_num_seqs))
            g.add_metric([self.model_name, "caps.token_budget", i],
                         float(inst.get("token_budget") or sched.max_num_batched_tokens))
            state = inst.get("policy")
            if isinstance(state, dict):
                for key, val in state_gauges(state):
                    g.add_metric([self.model_name, key, str(inst["index"])], val)
        return g

    def _single(self, s: dict[str, Any]) -> dict[str, Any]:
        """A single engine as the one instance of its own layout (what the monitor says of a cluster's)."""
        running, waiting = s.get("num_requests_running", 0), s.get("num_requests_waiting", 0)
        return {"instances": [{
            "index": 0, "role": "colocated", "kv_usage": s.get("kv_cache_usage_perc", 0.0), "num_running": running,
            "num_waiting": waiting, "num_blocks": s.get("num_kv_blocks", 0), "outstanding": running + waiting,
            "arrival_rate": self.arrival_rate(), "step_time_ema_s": s.get("step_time_ema_s"),
            "alive": bool(getattr(self.llm, "is_running", True)), "batch_size_cap": s.get("batch_size_cap"),
            "token_budget": s.get("token_budget"), "failures": 0, "restarts": 0}]}

    def _instances(self, s: dict[str, Any], cluster: dict[str, Any] | None) -> Iterable[Metric]:
        """Per-instance series (label ``instance``) and the cluster's events, from the monitor."""
        c = cluster if cluster is not None else self._single(s)
        series = (("kv_cache_usage_perc", "kv_usage", "Fraction of the instance's KV blocks in use (0..1)."),
                  ("num_requests_running", "num_running", "Requests running on the instance."),
                  ("num_requests_waiting", "num_waiting", "Requests waiting on the instance."),
                  ("num_kv_blocks_total", "num_blocks", "KV blocks in the instance's pool."),
                  ("outstanding_requests", "outstanding", "Requests dispatched to the instance and unfinished."),
                  ("arrival_rate", "arrival_rate", "Requests dispatched to the instance per second (10 s window)."),
                  ("step_time_seconds", "step_time_ema_s", "Moving average of the instance's step time "
                   "(0 before its first step)."),
                  ("alive", "alive", "1 while the instance's worker is serving."),
                  ("batch_size_cap", "batch_size_cap", "Cap on running requests the instance's policy set last step."),
                  ("token_budget", "token_budget", "Token budget the instance's scheduler used for its last step."))
        for name, key, doc in series:
            g = GaugeMetricFamily(f"tidal:instance_{name}", doc, labels=["model_name", "instance", "role"])
            for inst in c["instances"]:
                val = inst.get(key)
                g.add_metric([self.model_name, str(inst["index"]), inst["role"]], float(val or 0))
            yield g
        for name, key, doc in (("instance_failures", "failures", "Times the instance's worker died."),
                               ("instance_restarts", "restarts", "Times the instance's worker was restarted.")):
            cnt = CounterMetricFamily(f"tidal:{name}", doc, labels=["model_name", "instance"])
            for inst in c["instances"]:
                cnt.add_metric([self.model_name, str(inst["index"])], float(inst[key]))
            yield cnt
        for name, val, doc in (("request_failovers", s.get("failovers", 0),
                                "Requests re-run on another instance after theirs failed."),
                               ("kv_handoffs", c.get("num_handoffs", 0), "Prefill-to-decode KV hand-offs that landed."),
                               ("split_requests", s.get("splits", 0),
                                "Requests split into alpha and beta micro-requests (DynaServe, --mode split)."),
                               ("kv_transfer_bytes", s.get("kv_bytes_moved", 0),
                                "Bytes of KV moved between instances (hand-offs and splits).")):
            cnt = CounterMetricFamily(f"tidal:{name}", doc, labels=["model_name"])
            cnt.add_metric([self.model_name], float(val))
            yield cnt
        yield self._gauge("tidal:pending_handoffs", "Prefilled requests waiting for room on a decode instance.",
                          c.get("pending_handoffs", 0))
        kp = c.get("kv_pressure")
        if isinstance(kp, dict):  # --kv-pressure drop (KunServe); KV capacity is instance_num_kv_blocks_total
            from tidal.cluster.pressure import KINDS

            ev = CounterMetricFamily("tidal:kv_pressure_events", "KV-pressure decisions and their execution "
                                     "(throttle, drop, exchange, exchange-done, ...).", labels=["model_name", "kind"])
            for kind in KINDS:
                ev.add_metric([self.model_name, kind], float(kp["events_total"].get(kind, 0)))
            yield ev
            g = GaugeMetricFamily("tidal:instance_dropped_layers", "Decoder layers the instance dropped (KunServe).",
                                  labels=["model_name", "instance"])
            for inst in c["instances"]:
                g.add_metric([self.model_name, str(inst["index"])], float(kp["dropped_layers"].get(str(inst["index"]), 0)))
            yield g
            auto = kp.get("auto")
            if isinstance(auto, dict):  # --kv-pressure auto: the responses its throttle onsets took
                from tidal.cluster.pressure import TECHNIQUES

                ch = CounterMetricFamily("tidal:kv_pressure_auto_choices", "Responses --kv-pressure auto chose at "
                                         "throttle onsets.", labels=["model_name", "technique"])
                for t in TECHNIQUES:
                    ch.add_metric([self.model_name, t], float(auto["choices_total"].get(t, 0)))
                yield ch


class ServerMetrics:
    def __init__(self, llm: Any, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("tidal:time_to_first_token_seconds", "Time to first token (server side).",
                              lab, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tidal:inter_token_latency_seconds", "Time between output tokens.",
                             lab, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tidal:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             lab, buckets=LONG_BUCKETS, registry=r).labels(model_name)
        self.queue = Histogram("tidal:request_queue_time_seconds", "Time waiting before first scheduled.",
                               lab, buckets=LONG_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens processed.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tidal:generation_tokens", "Tokens generated.", lab,
                                         registry=r).labels(model_name)
        self.success = Counter("tidal:request_success", "Finished requests (choices) by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self.rejected = Counter("tidal:request_rejected",
                                "Requests refused at submission (queue full, rejected prompt, dead engine).",
                                ["model_name", "status"], registry=r)
        for status in REJECTED_STATUSES:
            self.rejected.labels(model_name, str(status))
        self._arrivals: deque[float] = deque()  # a single engine's request arrivals (monotonic), last 10 s
        r.register(_EngineCollector(llm, model_name, self.arrival_rate))
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends (the front end's process)

    def arrived(self) -> None:
        self._arrivals.append(time.monotonic())

    def arrival_rate(self, window_s: float = ARRIVAL_WINDOW_S) -> float:
        now = time.monotonic()
        while self._arrivals and self._arrivals[0] < now - window_s:
            self._arrivals.popleft()
        return len(self._arrivals) / window_s

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, start: float) -> RequestTracker:
        return RequestTracker(self, start)


class RequestTracker:
    """Latency bookkeeping of one engine request, fed with its outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.m = metrics
        self.start = start
        self.last_token: float | None = None
        self.queued_seen = False
        self.finished: dict[int, str] = {}
        self.num_choices = 0
        self.done = False

    def accepted(self, num_prompt_tokens: int, num_choices: int) -> None:
        self.m.prompt_tokens.inc(num_prompt_tokens)
        self.m.arrived()
        self.num_choices = num_choices

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        new = sum(len(c.delta_token_ids) for c in out.outputs)
        if new:
            if self.last_token is None:
                self.m.ttft.observe(now - self.start)
            else:
                self.m.itl.observe(now - self.last_token)
            self.last_token = now
            self.m.generation_tokens.inc(new)
        mt = out.metrics
        if not self.queued_seen and mt is not None and mt.first_scheduled_time is not None:
            self.m.queue.observe(max(0.0, mt.first_scheduled_time - mt.arrival_time))
            self.queued_seen = True
        for c in out.outputs:
            if c.finish_reason is not None and c.index not in self.finished:
                self.finished[c.index] = c.finish_reason
                self.m.success.labels(self.m.model_name, c.finish_reason).inc()
        if out.finished and not self.done:
            self.done = True
            self.m.e2e.observe(time.monotonic() - self.start)

    def close(self) -> None:
        """The stream ended (normally, or because the client went away): count what was cut off."""
        if self.done:
            return
        self.done = True
        for i in range(self.num_choices):
            if i not in self.finished:
                self.m.success.labels(self.m.model_name, "abort").inc()
        self.m.e2e.observe(time.monotonic() - self.start)
