"""tidal across two real Ray nodes on this machine (a head and one more, token authentication,
ports and temp dir of their own; ``tests/ray_nodes.py``), through ``tidal serve --backend ray
--ray-address`` and the official ``openai`` client: colocated, P/D (every request's KV handed
across the nodes through the object store, in chunks) and split; greedy answers equal one
instance, token for token. Each node has one CPU, so each of the two workers (one CPU each) runs
on its own node, which ``/admin/state`` shows."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from tests.ray_nodes import RayNodes  # noqa: E402
from tests.server.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS, ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow
COMMON = ("--instances", "2", "--backend", "ray", "--threads-per-instance", "1", "--kv-cache-memory", "64MiB")
LONG_PROMPT = ("The tides rise and fall twice a day because the moon and the sun pull on the oceans. "
               "Explain in simple words why there are two high tides and not one:")


@pytest.fixture(scope="module")
def nodes():
    cluster = RayNodes().start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def reference(make_engine):
    """One instance's greedy answers (the offline engine, the servers' dtype and KV size)."""
    from tidal import LLM, SamplingParams

    llm = LLM.from_engine(make_engine(kv_cache_memory="64MiB"))
    params = SamplingParams(temperature=0, max_tokens=REF_MAX_TOKENS)
    comp, long = llm.generate([COMPLETION_PROMPT, LONG_PROMPT], params)
    chat = llm.chat(CHAT_MESSAGES, params)[0]
    return {"completion": comp.outputs[0].text, "long": long.outputs[0].text, "chat": chat.outputs[0].text}


def serve(nodes: RayNodes, *flags: str) -> ServerProcess:
    return ServerProcess(*COMMON, "--ray-address", nodes.address, *flags, env=nodes.env).wait_ready()


def stop(server: ServerProcess) -> None:
    code = server.stop()
    assert code == 0, f"the server exited with {code}:\n{server.final_output[-3000:]}"
    assert "Traceback" not in server.final_output, server.final_output[-3000:]


def check_answers(server: ServerProcess, reference: dict) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=server.model, max_tokens=REF_MAX_TOKENS, temperature=0)
    for prompt, want in ((COMPLETION_PROMPT, reference["completion"]), (LONG_PROMPT, reference["long"])):
        assert client.completions.create(prompt=prompt, **kw).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **kw)
                           if c.choices)
        assert streamed == want
    assert client.chat.completions.create(messages=CHAT_MESSAGES, **kw).choices[0].message.content == reference["chat"]


def state(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/admin/state", timeout=10).json()


def assert_one_instance_per_node(st: dict) -> None:
    nodes = [i["node"] for i in st["cluster"]["instances"]]
    assert all(nodes) and len(set(nodes)) == 2, nodes


@pytest.mark.parametrize("mode", ["colocate", "disaggregate", "split"])
def test_greedy_answers_across_two_nodes_equal_one_instance(nodes, reference, mode):
    flags = {"colocate": (), "disaggregate": ("--mode", "disaggregate", "--prefill-instances", "1"),
             "split": ("--mode", "split")}[mode]
    server = serve(nodes, *flags)
    try:
        assert_one_instance_per_node(state(server))
        check_answers(server, reference)
        st = state(server)
        stats, cluster = st["stats"], st["cluster"]
        assert stats["failovers"] == 0 and stats["instance_failures"] == 0
        if mode == "disaggregate":  # every request's KV crossed to the other node
            assert cluster["num_handoffs"] == 5 and stats["kv_bytes_moved"] > 0
            assert [i["handoffs_in"] for i in cluster["instances"]] == [0, 5]
        if mode == "split":
            assert stats["splits"] >= 1 and stats["kv_bytes_moved"] > 0, stats
    finally:
        stop(server)
