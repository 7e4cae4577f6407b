"""The metric definitions of ``tidal.metrics``, checked exactly on hand-made records."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.metrics import (
    SLO,
    CapacitySearch,
    RequestRecord,
    SLOError,
    attains,
    benchmark_duration,
    distribution,
    in_flight_series,
    itl_from_chunks,
    parse_slo,
    slo_checks,
    summarize,
    tpot,
)

REPO = Path(__file__).resolve().parents[2]


def rec(i: int, ttft: float | None, e2e: float | None, out: int, ok: bool = True, send: float = 0.0,
        prompt: int = 10, itl: list[float] | None = None, error: str = "") -> RequestRecord:
    return RequestRecord(index=i, arrival_s=send, prompt_len=prompt, output_len=out, send_s=send,
                         end_s=None if e2e is None else send + e2e, success=ok, ttft_s=ttft, e2e_s=e2e,
                         itl_s=itl or [], prompt_tokens=prompt, output_tokens=out, error=error)


def test_tpot_definition():
    assert tpot(rec(0, 0.2, 0.7, 11)) == pytest.approx(0.05)
    assert tpot(rec(0, 0.2, 0.25, 2)) == pytest.approx(0.05)
    assert tpot(rec(0, 0.2, 0.2, 1)) is None  # one token: no TPOT
    assert tpot(rec(0, 0.2, 0.7, 11, ok=False)) is None
    assert tpot(rec(0, None, None, 0, ok=False)) is None


def test_itl_from_chunks_splits_multi_token_chunks():
    assert itl_from_chunks([1.0, 1.05, 1.1], [1, 1, 1]) == pytest.approx([0.05, 0.05])
    # a 2-token chunk 100 ms after the previous one: two gaps of 50 ms
    assert itl_from_chunks([1.0, 1.05, 1.15, 1.2], [1, 1, 2, 1]) == pytest.approx([0.05, 0.05, 0.05, 0.05])
    # extra tokens of the first chunk arrived with it: gaps of 0
    gaps = itl_from_chunks([0.5, 0.8], [3, 3])
    assert gaps == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.1])
    assert len(gaps) == 6 - 1 and sum(gaps) == pytest.approx(0.8 - 0.5)
    assert itl_from_chunks([], []) == []
    with pytest.raises(ValueError):
        itl_from_chunks([1.0, 2.0], [1, 0])
    with pytest.raises(ValueError):
        itl_from_chunks([1.0], [1, 1])


def test_distribution_percentiles_are_numpy_linear():
    d = distribution(range(1, 11))
    assert d["mean"] == 5.5 and d["min"] == 1 and d["max"] == 10 and d["count"] == 10
    assert d["p50"] == pytest.approx(5.5)
    assert d["p90"] == pytest.approx(9.1)  # rank 0.9 * 9 = 8.1 -> 9 + 0.1 * (10 - 9)
    assert d["p99"] == pytest.approx(9.91)
    assert d["std"] == pytest.approx(math.sqrt(8.25))
    ms = distribution([0.1, 0.2, None], scale=1000)
    assert ms["mean"] == pytest.approx(150) and ms["count"] == 2
    empty = distribution([])
    assert empty["count"] == 0 and empty["mean"] is None and empty["p99"] is None


def test_parse_slo():
    s = parse_slo("ttft=2000,tpot=200")
    assert s == SLO(ttft_s=2.0, tpot_s=0.2)
    assert parse_slo(" ttft = 150ms , e2e=3s ") == SLO(ttft_s=0.15, e2e_s=3.0)
    assert parse_slo("e2el=1500").e2e_s == 1.5
    assert parse_slo(None).empty and parse_slo("").empty
    assert s.to_ms() == {"ttft": 2000.0, "tpot": 200.0}
    for bad in ("ttft", "ttft=", "ttft=abc", "foo=1", "ttft=1,ttft=2", "ttft=0", "ttft=-5", "ttft=1;tpot=2"):
        with pytest.raises(SLOError):
            parse_slo(bad)


def test_attainment_rules():
    slo = SLO(ttft_s=0.5, tpot_s=0.1, e2e_s=2.0)
    assert attains(rec(0, 0.5, 1.4, 10), slo)  # 0.5 <= 0.5, tpot 0.1 <= 0.1: boundaries attain
    assert not attains(rec(0, 0.51, 1.4, 10), slo)
    assert not attains(rec(0, 0.2, 2.2, 10), slo)  # tpot 0.222 and e2e 2.2 miss
    assert slo_checks(rec(0, 0.2, 2.2, 10), slo) == {"ttft": True, "tpot": False, "e2e": False}
    assert attains(rec(0, 0.3, 0.3, 1), SLO(tpot_s=0.001))  # one token: no TPOT to miss
    assert not attains(rec(0, 0.1, 0.2, 5, ok=False), slo)  # failed never attains
    assert not attains(rec(0, 0.1, 0.2, 5, ok=False), SLO())
    assert attains(rec(0, 9.0, 99.0, 5), SLO())  # no SLO: succeeding is attaining


def test_summary_on_hand_made_records():
    records = [
        rec(0, 0.1, 1.1, 11, send=0.0, itl=[0.1] * 10),  # tpot 0.1
        rec(1, 0.3, 2.3, 21, send=1.0, itl=[0.1] * 20),  # tpot 0.1
        rec(2, 0.9, 1.9, 11, send=2.0, itl=[0.1] * 10),  # ttft misses 0.5
        rec(3, 0.2, 4.2, 11, send=3.0, itl=[0.4] * 10),  # tpot 0.4 misses 0.2
        RequestRecord(4, 4.0, 10, 11, send_s=4.0, end_s=4.5, success=False, status=500, error="HTTP 500: boom"),
    ]
    s = summarize(records, 10.0, SLO(ttft_s=0.5, tpot_s=0.2))
    assert s["num_requests"] == 5 and s["completed"] == 4 and s["failed"] == 1
    assert s["duration_s"] == 10.0
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 54
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(5.4)
    assert s["total_token_throughput"] == pytest.approx(9.4)
    assert s["ttft_ms"]["mean"] == pytest.approx(375.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(175.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 50
    assert s["itl_ms"]["mean"] == pytest.approx((40 * 100 + 10 * 400) / 50)
    assert s["e2el_ms"]["p50"] == pytest.approx(2100.0)
    assert s["e2el_ms"]["max"] == pytest.approx(4200.0)
    # 2 of 5 attain (the failed one counts against attainment)
    assert s["attained"] == 2
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert s["slo_attainment_by_metric"] == {"ttft": pytest.approx(0.6), "tpot": pytest.approx(0.6)}
    assert s["goodput"]["request_throughput"] == pytest.approx(0.2)
    assert s["goodput"]["output_throughput"] == pytest.approx(3.2)
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert s["slo"] == {"ttft": 500.0, "tpot": 200.0}
    # duration defaults to the last end; no SLO: attainment is the success rate
    s2 = summarize(records)
    assert s2["duration_s"] == benchmark_duration(records) == pytest.approx(7.2)
    assert s2["slo_attainment"] == pytest.approx(0.8)
    assert summarize([])["slo_attainment"] is None


def test_record_round_trip_and_in_flight():
    r = rec(3, 0.2, 0.7, 11, send=1.0, itl=[0.05] * 10)
    d = r.to_dict()
    assert d["tpot_s"] == pytest.approx(0.05) and d["queue_s"] == 0.0
    assert RequestRecord.from_dict(d) == r
    records = [rec(0, 0.1, 2.0, 2, send=0.0), rec(1, 0.1, 2.0, 2, send=1.0), rec(2, 0.1, 0.5, 2, send=2.0)]
    times, counts = in_flight_series(records)
    assert times == [0.0, 1.0, 2.0, 2.5, 3.0]
    assert counts == [1, 2, 2, 1, 0]  # at 2.0 one ends and one starts


def _search(capacity: float, low: float = 1.0, high: float = 64.0, **kw) -> CapacitySearch:
    s = CapacitySearch(low, high, target=0.9, **kw)
    while (rate := s.next_rate()) is not None:
        s.record(rate, 1.0 if rate <= capacity else 0.5)
    return s


def test_capacity_search_bisects_on_rate():
    s = _search(10.0, tolerance=0.05, max_probes=20)
    lo, hi = s.bracket
    assert lo <= 10.0 < hi and hi / lo <= 1.05
    assert s.capacity == lo
    assert [p.rate for p in s.probes][:3] == [1.0, 64.0, 8.0]  # low, high, then geometric midpoints
    rep = s.report()
    assert rep["capacity_rps"] == lo and rep["first_failing_rps"] == hi and len(rep["probes"]) == len(s.probes)
    assert "within" in rep["note"]
    below = _search(0.5)
    assert below.capacity is None and len(below.probes) == 1 and "low bound" in below.note
    above = _search(100.0)
    assert above.capacity == 64.0 and len(above.probes) == 2 and "high bound" in above.note
    capped = _search(10.0, tolerance=1e-6, max_probes=4)
    assert len(capped.probes) == 4 and "4 probes" in capped.note
    for bad in ((0, 1, 0.9), (2, 1, 0.9), (1, 2, 0), (1, 2, 1.5), (1, math.inf, 0.9)):
        with pytest.raises(ValueError):
            CapacitySearch(*bad)


def test_metrics_and_workloads_are_pure():
    """Importing the packages the simulator reuses loads no torch, threads, sockets or HTTP
    (tests/test_purity.py scans their sources for clocks)."""
    code = ("import sys, tidal.metrics, tidal.workload\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'threading', 'socket', 'aiohttp',"
            " 'asyncio', 'transformers')]\n"
            "print(bad)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_tbt_slo_is_each_requests_own_p99_gap():
    from tidal.metrics.serving import RequestRecord, slo_checks

    slo = parse_slo("tbt=100")
    assert slo.tbt_s == pytest.approx(0.1) and slo.describe() == "tbt <= 100 ms"
    smooth = RequestRecord(0, 0.0, 8, 200, success=True, itl_s=[0.05] * 200)
    one_stall = RequestRecord(1, 0.0, 8, 200, success=True, itl_s=[0.05] * 199 + [0.5])  # 1 of 200: under p99
    stalls = RequestRecord(2, 0.0, 8, 200, success=True, itl_s=[0.05] * 190 + [0.5] * 10)
    failed = RequestRecord(3, 0.0, 8, 200, success=False, itl_s=[0.05])
    assert [slo_checks(r, slo)["tbt"] for r in (smooth, one_stall, stalls, failed)] == [True, True, False, False]
