"""deploy/grafana/tidal.json queries only metrics that a live tidal server exposes, each with a
sample from the start (a panel shows 0, not "no data"): a single instance here, the multi-instance
servers in test_cluster_api.py, and colocated, P/D and split servers across Ray nodes in
tests/runtime/test_ray_nodes.py."""

from __future__ import annotations

from tests.server.grafana import PROMETHEUS, exposed, load_dashboard, metric_names, queries, unsampled_queries


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


def test_every_queried_metric_has_a_sample_in_a_single_server(server):
    assert not unsampled_queries(server.url)
    names = set().union(*map(metric_names, queries(load_dashboard())))
    assert names <= exposed(server.url)
