"""``tidal bench soak``, short: 10 s at 3x the measured capacity of a real server (small batch
and queue bound, so it is overloaded and refuses), with client disconnects and malformed requests
mixed in. The server must come out of it with 0 failed requests, 0 KV blocks in use once idle
and /health 200 at every sample."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import own_server
from tidal.bench import soak
from tidal.cli import main

FLAGS = ("--max-num-seqs", "4", "--max-queued-requests", "4", "--kv-cache-memory", "64MiB", "--num-threads", "1")


@pytest.fixture(scope="module")
def soak_server():
    with own_server(*FLAGS) as p:
        yield p


def test_short_soak_is_clean(soak_server, tmp_path, capsys):
    out = tmp_path / "soak.json"
    code = main(["bench", "soak", "--base-url", soak_server.url, "--duration", "10", "--max-tokens", "8",
                 "--measure-requests", "12", "--health-interval", "0.25", "--progress-interval", "5",
                 "--disconnect-fraction", "0.2", "--malformed-fraction", "0.15", "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.err, printed.out)  # the figures, in the test's output
    r = json.loads(out.read_text())
    assert r["failed"] == 0, r["errors"]
    assert r["idle"] and r["leaked_kv_blocks"] == 0
    assert r["health_always_200"] and r["health_samples"] >= 30  # sampled throughout (10 s of arrivals alone give 40)
    assert code == 0 and r["clean"] and "verdict: CLEAN" in printed.out
    # it did what it says: real traffic of every kind, every request accounted for
    assert r["completed"] > 0 and r["disconnected"] > 0 and r["malformed_sent"] > 0
    assert r["malformed_rejected"] + r["refused"] >= r["malformed_sent"] > 0
    assert r["sent"] == r["completed"] + r["refused"] + r["failed"] + r["disconnected"] + r["malformed_rejected"]
    assert r["capacity_measured"] and r["rate_rps"] == pytest.approx(3 * r["capacity_rps"])
    assert r["rss_start_bytes"] > 0 and r["rss_end_bytes"] > 0
    assert "] load: sent" in printed.err  # progress lines while it runs


def test_bad_fractions_are_refused_before_any_traffic(capsys):
    code = main(["bench", "soak", "--base-url", "http://127.0.0.1:9", "--disconnect-fraction", "0.7",
                 "--malformed-fraction", "0.5"])
    assert code == 2 and "at most 1" in capsys.readouterr().err


def test_summary_says_not_clean_when_something_failed():
    r = {"base_url": "http://x", "model": "m", "duration_s": 1.0, "rate_rps": 3.0, "multiple": 3.0,
         "capacity_rps": 1.0, "capacity_measured": False, "sent": 3, "completed": 1, "refused": 1, "failed": 1,
         "disconnected": 0, "malformed_rejected": 0, "malformed_sent": 0, "leaked_kv_blocks": 0,
         "rss_start_bytes": None, "rss_end_bytes": 2**20, "health_samples": 2, "health_statuses": {"200": 2},
         "health_always_200": True, "errors": {"HTTP 500: boom": 1}, "idle": True}
    assert not soak.clean(r)
    text = soak.format_summary(r)
    assert "NOT CLEAN" in text and "1 x HTTP 500: boom" in text
    assert soak.clean({**r, "failed": 0}) and not soak.clean({**r, "failed": 0, "leaked_kv_blocks": 3})
