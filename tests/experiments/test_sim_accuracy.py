"""``tidal bench sim-accuracy``: its arithmetic, its refusals, and a small end-to-end run on the real engine."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tidal.cli import main as cli_main
from tidal.experiments import sim_accuracy
from tidal.workload import RequestSpec


def _synthetic_profile(path: Path, threads: int) -> str:
    """A profile in the file format, with times of the real engine's order (5 ms + 0.1 ms per token)."""
    samples = []
    for p, d, c in itertools.product((0, 16, 64, 256), (0, 1, 4, 16), (64, 256)):
        if p == 0 and d == 0:
            continue
        chunks = [[c, 1, True]] * d + ([[0, p, True]] if p else [])
        t = 5e-3 + 1e-4 * (p + d) + 2e-7 * c * d
        samples.append({"chunks": chunks, "time_s": t, "times_s": [t]})
    data = {"format": "tidal-profile/1", "block_size": 16, "threads": threads, "samples": samples,
            "decode_grouping": {"fill": 0.67, "min_group": 4}, "overhead": {"per_step_s": 1e-4, "per_seq_s": 2e-6}}
    path.write_text(json.dumps(data))
    return str(path)


def _run(argv: list[str]) -> int:
    return cli_main(["bench", "sim-accuracy", *argv])  # through the real CLI, as a user runs it


def test_compare_and_medians():
    real = {"ttft_ms": {"p50": 100.0, "p99": 200.0}, "tpot_ms": {"p50": 10.0, "p99": 0.0}, "output_throughput": 50.0}
    sim = {"ttft_ms": {"p50": 110.0, "p99": 150.0}, "tpot_ms": {"p50": 9.0, "p99": 1.0}, "output_throughput": 55.0}
    rows = sim_accuracy.compare(real, sim)
    assert rows["ttft_p50_ms"]["error"] == pytest.approx(0.10)
    assert rows["ttft_p99_ms"]["error"] == pytest.approx(-0.25)
    assert rows["tpot_p50_ms"]["error"] == pytest.approx(-0.10)
    assert rows["tpot_p99_ms"]["error"] is None  # no error relative to zero
    assert rows["output_tok_s"] == {"engine": 50.0, "sim": 55.0, "error": pytest.approx(0.10)}
    runs = [{"ttft_ms": {"p50": v, "p99": 2 * v}, "tpot_ms": {"p50": 1.0, "p99": 3.0}, "output_throughput": v}
            for v in (3.0, 1.0, 2.0)]
    med = sim_accuracy.median_summary(runs)
    assert med["ttft_ms"] == {"p50": 2.0, "p99": 4.0} and med["output_throughput"] == 2.0 and len(med["runs"]) == 3


def test_specs_scale_with_the_rate():
    specs = sim_accuracy.make_specs(50, 0, (64, 512), (32, 128))
    assert all(64 <= s.prompt_len <= 512 and 32 <= s.output_len <= 128 for s in specs)
    assert specs == sim_accuracy.make_specs(50, 0, (64, 512), (32, 128))  # seeded
    fast = sim_accuracy.at_rate(specs, 4.0)
    assert [s.arrival_s for s in fast] == pytest.approx([s.arrival_s / 4 for s in specs])
    assert [(s.prompt_len, s.output_len) for s in fast] == [(s.prompt_len, s.output_len) for s in specs]
    assert isinstance(fast[0], RequestSpec)


def test_missing_profile_and_thread_mismatch_are_refused(tmp_path: Path, capsys):
    assert _run(["--profile", str(tmp_path / "none.json")]) == 2
    assert "profile not found" in capsys.readouterr().err
    prof = _synthetic_profile(tmp_path / "p.json", threads=1)
    assert _run(["--profile", prof, "--num-threads", "2", "--output", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "1 threads" in err and "--num-threads 1" in err
    assert not (tmp_path / "x.json").exists()


def test_small_run_end_to_end(tmp_path: Path, capsys, monkeypatch, smol_ckpt, reuse_smol_tokenizer):
    from tidal.engine import loader

    monkeypatch.setattr(loader, "load_checkpoint", lambda path=None: smol_ckpt)  # the session's checkpoint
    prof = _synthetic_profile(tmp_path / "p.json", threads=2)
    out = tmp_path / "acc.json"
    n = 8
    code = _run(["--profile", prof, "--num-requests", str(n), "--prompt-len", "16-48", "--output-len", "4-8",
                 "--loads", "0.3,0.85", "--output", str(out)])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "sim@speed" in stdout and "simulated saturation" in stdout and "torch" in stdout and "2 threads" in stdout
    res = json.loads(out.read_text())
    assert res["machine"]["threads"] == 2 and res["saturation_rps"] > 0
    from tidal.engine.sizing import dtype_name

    assert res["dtype"] == res["machine"]["dtype"] == dtype_name("auto") != "auto"  # the default, resolved
    assert [r["load"] for r in res["runs"]] == [0.3, 0.85]
    for run in res["runs"]:
        assert run["rate"] == pytest.approx(run["load"] * res["saturation_rps"])
        assert set(run["rows"]) == {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "output_tok_s"}
        for row in run["rows"].values():
            assert row["engine"] > 0 and row["sim"] > 0
            assert row["error"] == pytest.approx((row["sim"] - row["engine"]) / row["engine"])
        # every request completed on both sides
        assert len(run["engine_ttft_s"]) == n and all(t is not None and t > 0 for t in run["engine_ttft_s"])
        assert len(run["sim_ttft_s"]) == n and all(t is not None and t > 0 for t in run["sim_ttft_s"])
        assert len(run["step_time_ratio"]) == 1 and run["step_time_ratio"][0] > 0
    png = tmp_path / "acc.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
