"""deploy/grafana/tidal.json queries only metrics that a live tidal server exposes (single
instance here; the per-instance ones against a cluster in test_cluster_api.py)."""

from __future__ import annotations

from tests.server.grafana import PROMETHEUS, exposed, load_dashboard, metric_names, queries

# exported only by a multi-instance front end (tidal.server.metrics._EngineCollector._cluster)
CLUSTER_ONLY_PREFIX = "tidal:instance_"
CLUSTER_ONLY = {"tidal:request_failovers_total", "tidal:kv_handoffs_total", "tidal:split_requests_total",
                "tidal:kv_transfer_bytes_total", "tidal:pending_handoffs"}


def test_dashboard_json_is_well_formed():
    dash = load_dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert metric_names(t["expr"]), f"{p['title']}: no metric in {t['expr']!r}"
    names = set().union(*map(metric_names, queries(dash)))
    # the techniques are all on it: caps, policy state, per-instance KV use, latency, outcomes
    for name in ("tidal:batch_size_cap", "tidal:policy_state", "tidal:instance_kv_cache_usage_perc",
                 "tidal:time_to_first_token_seconds_bucket", "tidal:request_rejected_total",
                 "tidal:num_preemptions_total"):
        assert name in names
    with open(PROMETHEUS) as f:
        assert "metrics_path: /metrics" in f.read()


def test_every_queried_metric_exists_in_a_single_server(server):
    names = set().union(*map(metric_names, queries(load_dashboard())))
    missing = names - exposed(server.url)
    assert all(n.startswith(CLUSTER_ONLY_PREFIX) or n in CLUSTER_ONLY for n in missing), sorted(missing)
    assert names - missing, "the single server exposes none of the dashboard's metrics"
