"""``tidal serve`` with several instances, through the official ``openai`` client: greedy answers
equal one instance's, streaming and not, colocated, disaggregated (P/D hand-off) and on Ray;
per-instance series in /metrics and the cluster in /admin/state."""

from __future__ import annotations

import importlib.util

import httpx
import pytest

from tests.server.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS, ServerProcess

COMMON = ("--instances", "2", "--threads-per-instance", "1", "--kv-cache-memory", "64MiB")
LAYOUTS = {
    "colocate": (),
    "disaggregate": ("--mode", "disaggregate", "--prefill-instances", "1"),
    "ray": ("--backend", "ray"),
}


@pytest.fixture(scope="module")
def cluster_servers(server_procs):
    """All cluster servers start together so their workers' model loads overlap."""
    names = [n for n in LAYOUTS if n != "ray" or importlib.util.find_spec("ray") is not None]
    procs = {n: ServerProcess(*COMMON, *LAYOUTS[n]) for n in names}
    yield procs
    for p in procs.values():
        p.terminate()
    codes = {n: p.stop() for n, p in procs.items()}
    assert codes == dict.fromkeys(procs, 0), f"cluster servers exited with {codes}"
    for n, p in procs.items():
        assert "Traceback" not in p.final_output, f"{n} server logged an exception:\n{p.final_output[-3000:]}"


@pytest.fixture(params=list(LAYOUTS))
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


def test_instances_show_in_metrics_and_admin_state(cluster_server):
    state = httpx.get(f"{cluster_server.url}/admin/state", timeout=10).json()
    inst = state["cluster"]["instances"]
    assert [i["index"] for i in inst] == [0, 1] and all(i["alive"] for i in inst)
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
