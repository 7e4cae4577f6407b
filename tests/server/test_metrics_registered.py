"""Every metric the Grafana dashboard queries has a sample from the first scrape, in every server
mode, 0 where the mode never moves it: a single engine shows itself as instance 0, with the
cluster-only counters at 0; a cluster's front end exports the token budget and the policy state of
its instances. Driven on the metrics collector with the stats each kind of server gives it (the live
servers are checked in test_grafana.py, test_cluster_api.py and tests/runtime/test_ray_nodes.py)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.grafana import load_dashboard, metric_names, queries
from tidal.cluster.monitor import GlobalMonitor, InstanceStatus
from tidal.config import SchedulerConfig
from tidal.core.policy import PolicyState
from tidal.server.metrics import ServerMetrics

QUERIED = set().union(*map(metric_names, queries(load_dashboard())))


class _LLM:
    def __init__(self, stats):
        self.stats = stats
        self.is_running = True
        self.engine = SimpleNamespace(config=SimpleNamespace(scheduler=SchedulerConfig(max_num_seqs=8)))


def _samples(stats) -> dict[str, list]:
    text = generate_latest(ServerMetrics(_LLM(stats), "m").registry).decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _single_stats():
    return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0, "num_kv_blocks": 100,
            "num_free_kv_blocks": 100, "num_preemptions": 0, "batch_size_cap": 8, "token_budget": 512,
            "policy": PolicyState("continuous"), "step_time_ema_s": None}


def _cluster_stats(roles, policy=None):
    mon = GlobalMonitor([InstanceStatus(i, 50, 50, 16, policy=policy) for i in range(len(roles))], roles)
    return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0, "num_kv_blocks": 100,
            "num_free_kv_blocks": 100, "num_preemptions": 0, "instance_failures": 0, "instance_restarts": 0,
            "failovers": 0, "splits": 0, "kv_bytes_moved": 0, "cluster": {"mode": "x", **mon.snapshot(0.0)}}


def test_a_single_engine_exports_every_queried_metric_at_start():
    got = _samples(_single_stats())
    assert set(got) >= QUERIED
    assert sorted((s.labels["key"], s.value) for s in got["tidal:policy_state"]) == \
        [("caps.max_num_seqs", 8.0), ("caps.token_budget", 512.0)]  # the continuous baseline: its caps
    assert [s.value for s in got["tidal:split_requests_total"]] == [0.0]
    assert [s.value for s in got["tidal:request_failovers_total"]] == [0.0]
    assert [(s.labels["instance"], s.labels["role"], s.value) for s in got["tidal:instance_alive"]] == [("0", "colocated", 1.0)]
    assert [s.value for s in got["tidal:instance_num_kv_blocks_total"]] == [100.0]
    assert [s.value for s in got["tidal:instance_restarts_total"]] == [0.0]
    assert sorted(s.labels["status"] for s in got["tidal:request_rejected_total"]) == ["400", "500", "503"]


def test_clusters_and_split_servers_export_every_queried_metric_at_start():
    for roles in (["colocated", "colocated"], ["prefill", "decode"]):
        got = _samples(_cluster_stats(roles, policy={"policy": "slo", "b_sla": 6, "inner": {"x": 1.5}}))
        assert set(got) >= QUERIED, QUERIED - set(got)
        assert [s.value for s in got["tidal:token_budget"]] == [512.0]  # the configured one
        assert sorted((s.labels["instance"], s.labels["key"], s.value) for s in got["tidal:policy_state"]) == \
            [(i, k, v) for i in "01" for k, v in (("b_sla", 6.0), ("caps.max_num_seqs", 8.0),
                                                     ("caps.token_budget", 512.0), ("inner.x", 1.5))]
        assert [s.value for s in got["tidal:instance_step_time_seconds"]] == [0.0, 0.0]  # no step yet
        assert [s.labels["role"] for s in got["tidal:instance_alive"]] == roles
    got = _samples(_cluster_stats(["colocated", "colocated"]))  # the baseline policy: only its caps
    assert set(got) >= QUERIED
    assert sorted(s.labels["key"] for s in got["tidal:policy_state"]) == ["caps.max_num_seqs"] * 2 + ["caps.token_budget"] * 2


def test_preemptions_are_counted_by_what_they_did():
    """``tidal:preemptions_total{mode}``: swapped out, or recomputed (recompute mode, or a swap that
    found the host pool full, also counted as ``tidal:swap_fallbacks_total``), one engine or a cluster."""
    for stats in ({**_single_stats(), "num_preemptions": 5, "num_swap_preemptions": 3, "num_swap_fallbacks": 2},
                  {**_cluster_stats(["colocated", "colocated"]), "num_preemptions": 5, "num_swap_preemptions": 3,
                   "num_swap_fallbacks": 2}):
        got = _samples(stats)
        assert {s.labels["mode"]: s.value for s in got["tidal:preemptions_total"]} == {"swap": 3.0, "recompute": 2.0}
        assert [s.value for s in got["tidal:swap_fallbacks_total"]] == [2.0]
    got = _samples(_single_stats())  # before any preemption (and a stats dict without the counts)
    assert {s.labels["mode"]: s.value for s in got["tidal:preemptions_total"]} == {"swap": 0.0, "recompute": 0.0}
