"""``tidal serve`` with several instances, through the official ``openai`` client: greedy answers
equal one instance's, streaming and not, colocated, disaggregated (P/D hand-off) and on Ray;
per-instance series in /metrics and the cluster in /admin/state."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import (
    CHAT_MESSAGES,
    CLUSTER_LAYOUTS,
    COMPLETION_PROMPT,
    REF_MAX_TOKENS,
    ServerProcess,
    launch_cluster,
    stop_cluster_later,
)


@pytest.fixture(scope="module")
def cluster_servers(server_procs):
    """Every layout's server (``--instances 2 --threads-per-instance 1 --kv-cache-memory 64MiB``
    plus the layout's flags; conftest's CLUSTER_*), all started together so their workers' model
    loads overlap; most were launched in the background when the server tests began. When the
    module ends they are terminated, and ``server_procs`` checks at the end of the session that
    each exited with 0 and logged no exception."""
    procs = launch_cluster()
    for p in procs.values():
        p.normal_policy()
    yield procs
    stop_cluster_later()


@pytest.fixture(params=list(CLUSTER_LAYOUTS))
def cluster_server(request, cluster_servers) -> ServerProcess:
    if request.param not in cluster_servers:
        pytest.skip("Ray is not installed (pip install -e '.[ray]')")
    return cluster_servers[request.param].wait_ready()


def test_greedy_answers_equal_one_instance(cluster_server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(model=model, max_tokens=REF_MAX_TOKENS, temperature=0)
    comp = client.completions.create(prompt=COMPLETION_PROMPT, **kw)
    assert comp.choices[0].text == reference["completion"]
    assert comp.usage.completion_tokens == len(reference["completion_ids"])
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=COMPLETION_PROMPT, stream=True, **kw)
                       if c.choices)
    assert streamed == reference["completion"]
    chat = client.chat.completions.create(messages=CHAT_MESSAGES, **kw)
    assert chat.choices[0].message.content == reference["chat"]
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(messages=CHAT_MESSAGES, stream=True, **kw) if c.choices)
    assert streamed == reference["chat"]


def test_every_metric_the_dashboard_queries_has_a_sample(cluster_server):
    from tests.server.grafana import unsampled_queries

    assert not unsampled_queries(cluster_server.url)


def test_instances_show_in_metrics_and_admin_state(cluster_server):
    state = httpx.get(f"{cluster_server.url}/admin/state", timeout=10).json()
    inst = state["cluster"]["instances"]
    assert [i["index"] for i in inst] == [0, 1] and all(i["alive"] for i in inst)
    # each worker reports what runs its model; start-up prints it per instance
    weights = state["cluster"]["weights"]
    assert len(weights) == 2 and all(w.startswith("float32, weights: ") for w in weights), weights
    printed = [ln for ln in cluster_server.output().splitlines() if ln.startswith("instance ")]
    assert printed == [f"instance {i} engine: {w}" for i, w in enumerate(weights)], printed
    assert state["cluster"]["num_dispatched"] >= 1
    lines = httpx.get(f"{cluster_server.url}/metrics", timeout=10).text.splitlines()
    for i in (0, 1):
        alive = [ln for ln in lines if ln.startswith("tidal:instance_alive{") and f'instance="{i}"' in ln]
        assert len(alive) == 1 and alive[0].endswith(" 1.0"), alive
    assert any(ln.startswith("tidal:instance_kv_cache_usage_perc{") for ln in lines)
    assert any(ln.startswith("tidal:instance_failures_total{") for ln in lines)
    if state["cluster"]["mode"] == "disaggregate":
        assert [i["role"] for i in inst] == ["prefill", "decode"]
        assert state["cluster"]["num_handoffs"] >= 1


def test_bench_serve_breaks_the_run_down_per_instance(cluster_servers, tmp_path, capsys):
    import json

    from tidal.cli import main

    server = cluster_servers["disaggregate"].wait_ready()
    out = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", server.url, "--workload", "fixed:16:4", "--num-requests", "6",
                 "--rate", "inf", "--warmup-requests", "0", "--no-progress", "--no-plots", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    res = json.loads(out.read_text())
    prefill, decode = res["instances"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["dispatched"] == 6 and decode["dispatched"] == 0  # every request enters on the prefill side
    assert decode["handoffs_in"] == 6 and prefill["failures"] == decode["failures"] == 0
    assert "Instances" in capsys.readouterr().out


def test_instance_breakdown_is_the_difference_of_the_counters():
    from tidal.bench.serve import instance_breakdown

    before = {"instances": [{"index": 0, "role": "colocated", "dispatched": 5, "handoffs_in": 0, "failures": 1,
                             "restarts": 1}]}
    after = {"instances": [{"index": 0, "role": "colocated", "alive": True, "dispatched": 12, "handoffs_in": 0,
                            "failures": 2, "restarts": 2, "kv_usage": 0.25, "step_time_ema_s": 0.01},
                           {"index": 1, "role": "colocated", "alive": False, "dispatched": 3, "handoffs_in": 0,
                            "failures": 0, "restarts": 0, "kv_usage": 0.0, "step_time_ema_s": None}]}
    got = instance_breakdown(before, after)
    assert [(g["dispatched"], g["failures"], g["restarts"]) for g in got] == [(7, 1, 1), (3, 0, 0)]
    assert instance_breakdown(before, None) is None


def test_grafana_queries_exist_in_single_and_cluster_servers(server, cluster_servers):
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server.grafana import exposed, load_dashboard, metric_names, queries

    cluster = cluster_servers["colocate"].wait_ready()
    names = set().union(*map(metric_names, queries(load_dashboard())))
    assert not names - (exposed(server.url) | exposed(cluster.url))
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{cluster.url}/metrics").text)}
    caps = {s.labels["instance"]: s.value for s in fams["tidal:instance_batch_size_cap"].samples}
    state = httpx.get(f"{cluster.url}/admin/state").json()["cluster"]["instances"]
    assert caps == {str(i["index"]): i["batch_size_cap"] for i in state} and set(caps) == {"0", "1"}


def test_dashboard_shows_every_instance(cluster_servers, tmp_path):
    from tests.server.browser import headless_chromium, screenshot, table, text, wait_for

    cluster = cluster_servers["colocate"].wait_ready()
    with headless_chromium() as d:
        d.get(f"{cluster.url}/dashboard")
        wait_for(lambda: d.execute_script("return window.tidalDashboard && window.tidalDashboard.polls >= 2"), 60,
                 "the page's first polls")
        state = httpx.get(f"{cluster.url}/admin/state").json()
        insts = state["cluster"]["instances"]
        rows = table(d, "instances")
        assert [r[0] for r in rows] == [str(i["index"]) for i in insts] == ["0", "1"]
        for r, i in zip(rows, insts, strict=True):
            assert r[1] == i["role"] and r[2] == "alive"
            assert r[5] == f"{i['num_blocks'] - i['num_free_blocks']} / {i['num_blocks']}"
            assert r[8] == str(i["batch_size_cap"]) and r[9] == str(i["token_budget"])
        assert text(d, "v-kv-total") == str(state["stats"]["num_kv_blocks"])
        assert text(d, "layout").startswith("colocate, 2 instances")
        assert len(table(d, "policy")) == 0 or {r[0] for r in table(d, "policy")} <= {"0", "1"}
        screenshot(d, tmp_path / "dashboard-cluster.png")
