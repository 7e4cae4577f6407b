"""The live page ``/dashboard`` in a real headless Chromium against a real server (BucketServe +
memory + SLA caps, so buckets and caps exist): it shows what ``/admin/state`` says, and it updates
while a load runs. The screenshot lands in the test's tmp_path (its path is printed)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from tests.server.browser import headless_chromium, screenshot, table, text, wait_for
from tests.server.conftest import ServerProcess, own_server
from tidal.server.dashboard import STATIC, RecentLatency

FLAGS = ("--batching", "bucket+memory+sla", "--tbt-slo-ms", "200", "--max-num-seqs", "8",
         "--kv-cache-memory", "64MiB", "--num-threads", "1")


@pytest.fixture(scope="module")
def policy_server():
    with own_server(*FLAGS) as p:
        yield p


def _load(url: str, n: int, max_tokens: int, repeat: int = 1) -> list[int]:
    def one(i: int) -> int:
        body = {"prompt": f"Request {i}: " + "tell me about the sea. " * repeat * (1 + i % 6), "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=300).status_code

    with cf.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_recent_latency_buckets_by_wall_clock():
    now = [1000.0]
    r = RecentLatency(bucket_s=5, window_s=60, clock=lambda: now[0])
    r.ttft(0.2)
    r.ttft(0.4)
    r.itl(0.05)
    now[0] = 1007.0
    r.itl(0.03)
    r.finished(1.0)
    s = r.series(60)
    assert [b["t"] for b in s["buckets"]] == [1000.0, 1005.0]
    first, second = s["buckets"]
    assert first["first_tokens"] == 2 and first["ttft_mean_s"] == pytest.approx(0.3) and first["ttft_max_s"] == 0.4
    assert second["ttft_mean_s"] is None and second["itl_mean_s"] == pytest.approx(0.03) and second["requests"] == 1
    assert s["totals"] == {"requests": 1, "first_tokens": 2, "tokens": 2}
    now[0] = 1100.0  # the window moved past both buckets
    assert r.series(30)["buckets"] == []


def test_page_files_are_package_data():
    """Every file of the page is in the wheel (pyproject's package-data) and read by the server."""
    import fnmatch
    import os

    tomllib = pytest.importorskip("tomllib")
    import tidal.server

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["tidal.server"]
    shipped = sorted(os.listdir(os.path.join(os.path.dirname(tidal.server.__file__), "static")))
    assert shipped == sorted(STATIC)
    assert all(any(fnmatch.fnmatch(f"static/{n}", g) for g in globs) for n in shipped)


def test_dashboard_files_are_served(policy_server):
    url = policy_server.url
    page = httpx.get(f"{url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in ("/dashboard/chart.js", "/dashboard/dashboard.js"):  # served by us, not a CDN
        assert f'src="{src}"' in page.text
        js = httpx.get(f"{url}{src}")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"] and len(js.text) > 1000
    assert "http://" not in page.text and "https://" not in page.text
    assert httpx.get(f"{url}/dashboard/nothing.js").status_code == 404
    assert httpx.get(f"{url}/admin/latency", params={"window": 0}).status_code == 400


def test_dashboard_shows_state_and_updates_under_load(policy_server, tmp_path):
    url = policy_server.url
    with headless_chromium() as d:
        d.get(f"{url}/dashboard")
        wait_for(lambda: d.execute_script("return window.tidalDashboard && window.tidalDashboard.polls >= 2 "
                                          "&& window.tidalDashboard.latencyPolls >= 1"), 60, "the page's first polls")
        state = httpx.get(f"{url}/admin/state").json()  # idle: nothing changes between the two reads
        s = state["stats"]
        assert text(d, "model") == state["model"]
        assert text(d, "alive") == "alive"
        assert text(d, "policy-name") == state["policy"]["policy"] == "bucket+memory+sla"
        assert text(d, "v-kv-total") == str(s["num_kv_blocks"])
        assert text(d, "v-kv-used") == str(s["num_kv_blocks"] - s["num_free_kv_blocks"]) == "0"
        assert text(d, "v-running") == str(s["num_requests_running"]) == "0"
        assert text(d, "v-batch-cap") == str(state["batch_size_cap"])
        expected_budget = s.get("token_budget") or state["scheduler"]["max_num_batched_tokens"]
        assert text(d, "v-token-budget") == str(expected_budget)
        [inst] = table(d, "instances")
        assert inst[0] == "0" and inst[2] == "alive" and inst[5] == f"0 / {s['num_kv_blocks']}"
        buckets = state["policy"]["bucket"]["buckets"]
        assert [r[2:4] for r in table(d, "buckets")] == [[str(b[0]), str(b[1])] for b in buckets]
        policy_rows = {r[1]: r[2] for r in table(d, "policy")}
        assert policy_rows["memory.eps_m"] == str(state["policy"]["memory"]["eps_m"])
        finished_before = int(text(d, "v-finished"))
        polls_before = d.execute_script("return window.tidalDashboard.polls")

        codes = _load(url, 12, 48)
        assert codes == [200] * 12

        latency = httpx.get(f"{url}/admin/latency").json()
        assert latency["totals"]["requests"] == finished_before + 12
        wait_for(lambda: text(d, "v-finished") == str(latency["totals"]["requests"]), 30,
                 "the page to count the finished requests")
        assert d.execute_script("return window.tidalDashboard.polls") > polls_before
        # the page saw the load while it ran: requests running and KV blocks in use at some poll
        seen = d.execute_script("return window.tidalDashboard.history.map(h => [h.running, h.insts[0].used])")
        assert max(r for r, _ in seen) > 0 and max(u for _, u in seen) > 0
        ttft_points = d.execute_script("return window.tidalDashboard.latency.buckets.filter(b => b.ttft_mean_s !== null).length")
        assert ttft_points >= 1
        wait_for(lambda: text(d, "v-running") == "0" and text(d, "v-kv-used") == "0", 30, "the page to show idle again")
        assert text(d, "error") == ""
        shot = screenshot(d, tmp_path / "dashboard.png")
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_dashboard_shows_kunserve_drop_exchange_and_restore(tmp_path):
    """A 2-instance cluster with --kv-pressure drop and a tiny KV pool: a burst throttles it, the
    pair drops layers, exchanges KV and, once idle, restores; the page lists those events (as the
    front end logged them in /admin/state) and, while grouped, which layers each instance holds."""
    p = ServerProcess("--instances", "2", "--kv-pressure", "drop", "--kv-cache-memory", "8MiB",
                      "--max-num-batched-tokens", "64", "--threads-per-instance", "1")
    try:
        url = p.wait_ready().url
        with headless_chromium() as d:
            d.get(f"{url}/dashboard")
            wait_for(lambda: d.execute_script("return window.tidalDashboard && window.tidalDashboard.polls >= 2"),
                     60, "the page's first polls")
            assert [r[-1] for r in table(d, "instances")] == ["all", "all"]
            layers_seen = []

            def watch() -> bool:
                layers_seen.append(tuple(r[-1] for r in table(d, "instances")))
                # the page redraws the table once a second (STATE_MS): four looks per redraw see
                # every layout it shows, without a busy loop of WebDriver calls beside the load
                time.sleep(0.25)
                return False

            with cf.ThreadPoolExecutor(1) as pool:
                load = pool.submit(_load, url, 8, 16, 4)  # prompts of ~30-150 tokens: far more than 2 x 176 slots
                while not load.done():
                    watch()
                assert load.result() == [200] * 8
            kinds = [e["kind"] for e in httpx.get(f"{url}/admin/state").json()["cluster"]["kv_pressure"]["events"]]
            assert "drop" in kinds, kinds

            def logged() -> str:
                return d.execute_script("return document.getElementById('events').textContent")

            wait_for(lambda: "kv-pressure drop: drop on instance(s) " in logged(), 30, "the drop on the page")
            wait_for(lambda: "kv-pressure drop: restore-done" in logged(), 120, "the restore on the page")
            assert "kv-pressure drop: exchange-done" in logged()
            assert any(a != "all" and b != "all" for a, b in layers_seen), layers_seen  # e.g. [0, 15) / [15, 30)
            wait_for(lambda: [r[-1] for r in table(d, "instances")] == ["all", "all"], 30, "all layers back")
            screenshot(d, tmp_path / "dashboard_kunserve.png")
    finally:
        code = p.stop()
    assert code == 0, p.final_output[-3000:]
