"""``tidal bench sim-prefix`` end to end on a small trace of its own: every setup runs, the hit rates sit
under their bounds (and the host tier adds hits), cache-aware routing hits more than least-outstanding
on families of shared prefixes, and the page is written from the JSON."""

from __future__ import annotations

import json
import random

from tidal.cli import main


def small_trace(path, n: int = 160) -> None:
    """Requests of 1-3 Mooncake blocks (512 tokens) in 8 families that share their first block."""
    rng = random.Random(3)
    t = 0.0
    with open(path, "w") as f:
        for i in range(n):
            t += rng.expovariate(4.0)
            fam = rng.randrange(8)
            ids = [fam, 100 + fam * 10 + rng.randrange(3)] + ([1000 + i] if rng.random() < 0.5 else [])
            length = 512 * (len(ids) - 1) + rng.randrange(50, 500)
            f.write(json.dumps({"timestamp": int(1000 * t), "input_length": length, "output_length": rng.randrange(4, 40),
                                "hash_ids": ids}) + "\n")


def test_sim_prefix_runs_every_setup_and_writes_the_page(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    small_trace(trace)
    out, page = tmp_path / "out", tmp_path / "cache.md"
    code = main(["bench", "sim-prefix", "--trace", str(trace), "--workloads", "trace", "--instances", "4", "--host-tiers", "1",
                 "--routing-tier", "1", "--rates", "2", "--jobs", "1", "--output", str(out), "--page", str(page),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    res = json.loads((out / "sim_prefix.json").read_text())["workloads"][0]
    off, pool, host = res["caching"]
    assert off["at_trace_rate"]["prefix_cache"] is None  # caching off: no queries
    p, h = pool["at_trace_rate"]["prefix_cache"], host["at_trace_rate"]["prefix_cache"]
    for pc in (p, h):
        assert 0 < pc["hit_rate"] <= pc["unbounded_hit_rate_as_routed"] + 1e-9 <= pc["unbounded_hit_rate"] + 2e-9
    assert h["hit_rate"] >= p["hit_rate"]
    routers = res["routing"]["routers"]
    hit = {name: d["sweep"][0]["prefix_cache"]["hit_rate"] for name, d in routers.items()}
    assert hit["cache-aware"] > hit["least-outstanding"]
    text = page.read_text()
    assert "| cache-aware | 2 |" in text and "What the routing comparison shows" in text
    assert "prefix_routing_trace.png" in text and (out / "prefix_routing_trace.png").exists()
