"""tidal across two real Ray nodes on this machine (a head and one more, token authentication,
ports and temp dir of their own; ``tests/ray_nodes.py``), through ``tidal serve --backend ray
--ray-address`` and the official ``openai`` client: colocated, P/D (every request's KV handed
across the nodes through the object store, in chunks) and split; greedy answers equal one
instance, token for token. Each node has one CPU, so each of the two workers (one CPU each) runs
on its own node, which ``/admin/state`` shows."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from tests.ray_nodes import RayNodes, process_tree  # noqa: E402
from tests.server.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS, ServerProcess  # noqa: E402
from tests.server.grafana import unsampled_queries  # noqa: E402

pytestmark = pytest.mark.slow
COMMON = ("--instances", "2", "--backend", "ray", "--threads-per-instance", "1", "--kv-cache-memory", "64MiB")
LONG_PROMPT = ("The tides rise and fall twice a day because the moon and the sun pull on the oceans. "
               "Explain in simple words why there are two high tides and not one:")
# the streams a kill interrupts: long enough (past the end of text, too) that every one is still running when
# the kill lands, however fast the instances are (REF_MAX_TOKENS' answers could all end before it)
KILL_TOKENS = 160


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
    killed = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=KILL_TOKENS, ignore_eos=True))[0]
    return {"completion": comp.outputs[0].text, "long": long.outputs[0].text, "chat": chat.outputs[0].text,
            "long_kill": killed.outputs[0].text}


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
    flags = {"colocate": ("--ray-placement", "strict-spread"), "disaggregate": ("--mode", "disaggregate", "--prefill-instances", "1"),
             "split": ("--mode", "split")}[mode]
    server = serve(nodes, *flags)
    try:
        assert not unsampled_queries(server.url)  # every panel of the dashboard has a series from the start
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


def metric(server: ServerProcess, name: str) -> dict[str, float]:
    """``name``'s samples by their ``instance`` label."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.labels.get("instance", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def wait_for(cond, what: str, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.5)
    pytest.fail(f"not within {timeout_s:.0f} s: {what}")


def stream_all(server: ServerProcess, n: int, killer, max_tokens: int = REF_MAX_TOKENS,
               ignore_eos: bool = False) -> list[str]:
    """``n`` greedy streams at once; ``killer()`` runs once every stream has its first tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    started = threading.Barrier(n + 1)

    def one(_: int) -> str:
        chunks = client.completions.create(model=server.model, prompt=LONG_PROMPT, max_tokens=max_tokens,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True} if ignore_eos else None)
        text, waited = "", False
        for c in chunks:
            text += c.choices[0].text if c.choices else ""
            if not waited and text:
                waited = True
                started.wait(timeout=300)
        return text

    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(one, k) for k in range(n)]
        started.wait(timeout=300)
        killer()
        return [f.result() for f in futs]


def test_a_killed_actor_loses_no_request_and_is_restarted(nodes, reference):
    """SIGKILL the worker actor on the second node while 8 streams run: every stream ends with one
    instance's answer (its requests re-run on the survivor from prompt + streamed tokens), the
    instance comes back (a new actor) and the restart is counted in /metrics."""
    server = serve(nodes)
    try:
        st = state(server)
        assert_one_instance_per_node(st)
        victim = next(i for i in st["cluster"]["instances"] if i["pid"] in process_tree(nodes.nodes["node2"].pid))
        texts = stream_all(server, 8, lambda: os.kill(victim["pid"], signal.SIGKILL), KILL_TOKENS, ignore_eos=True)
        assert texts == [reference["long_kill"]] * 8
        wait_for(lambda: metric(server, "tidal:instance_restarts_total").get(str(victim["index"])) == 1.0,
                 "the killed instance restarted")
        after = state(server)
        inst = after["cluster"]["instances"][victim["index"]]
        assert inst["alive"] and inst["failures"] == 1 and inst["pid"] != victim["pid"]
        assert metric(server, "tidal:instance_failures_total")[str(victim["index"])] == 1.0
        assert after["stats"]["failovers"] >= 1
        check_answers(server, reference)  # both instances serve again
    finally:
        stop(server)


def test_a_stopped_node_loses_no_request_and_its_instance_returns_with_a_node(nodes, reference):
    """Stop the second node (its raylet and everything under it) while 8 streams run: every stream
    ends with one instance's answer on the survivor; the lost instance's new actor waits for room
    (the head has none left) and starts when a node joins again; the restart is counted."""
    server = serve(nodes)
    try:
        st = state(server)
        victim = next(i for i in st["cluster"]["instances"] if i["pid"] in process_tree(nodes.nodes["node2"].pid))
        texts = stream_all(server, 8, lambda: nodes.stop_node("node2"))
        assert texts == [reference["long"]] * 8
        wait_for(lambda: not state(server)["cluster"]["instances"][victim["index"]]["alive"], "the loss seen")
        assert metric(server, "tidal:instance_restarts_total").get(str(victim["index"])) == 0.0
        nodes.add_node("node2")
        wait_for(lambda: metric(server, "tidal:instance_restarts_total").get(str(victim["index"])) == 1.0,
                 "the lost instance restarted on the new node")
        inst = state(server)["cluster"]["instances"][victim["index"]]
        assert inst["alive"] and inst["node"] not in (None, victim["node"])
        check_answers(server, reference)
    finally:
        stop(server)


PLACE = """
import sys
from tidal.config import ConfigError
from tidal.runtime.backend import RayBackend
n, timeout_s = int(sys.argv[2]), float(sys.argv[3])
try:
    backend = RayBackend(sys.argv[1], num_instances=n, placement="strict-spread", placement_timeout_s=timeout_s)
except ConfigError as e:
    print("ERROR", e)
else:
    print("PLACED", backend.pg is not None)
    backend.shutdown()
"""


def test_a_placement_the_cluster_cannot_give_is_a_clear_error(nodes):
    """Three instances, each on a node of its own, on two nodes: a one-line error naming the nodes;
    two fit. (A process of its own joins the cluster: the test process stays no Ray driver.)"""
    import subprocess
    import sys

    def place(n: int, timeout_s: float) -> str:
        out = subprocess.run([sys.executable, "-c", PLACE, nodes.address, str(n), str(timeout_s)], env=nodes.env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        # Ray may print lines of its own on a busy machine: the last of ours
        return [line for line in out.stdout.splitlines() if line.startswith(("ERROR ", "PLACED "))][-1]

    got = place(3, 5)
    assert got.startswith("ERROR the Ray cluster cannot place 3 instances of {'CPU': 1.0} with --ray-placement "
                          "strict-spread within 5 s; its 2 live node(s) have "), got
    assert place(2, 120) == "PLACED True"
