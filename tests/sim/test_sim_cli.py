"""``tidal sim`` end to end: JSON with the bench's keys, plots, capacity search, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tidal.sim import run as sim_run


def _run(argv):
    return sim_run.main(argv)


def test_sim_writes_summary_json_and_plots(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = _run(["--model", "llama-2-7b", "--hardware", "a100-40g", "--instances", "2", "--workload", "sharegpt",
               "--num-requests", "120", "--rate", "2", "--slo", "ttft=3000,tpot=150", "--output", str(out),
               "--no-progress", "--batching", "bucket+memory+sla", "--tbt-slo-ms", "50"])
    assert rc == 0
    r = json.loads(out.read_text())
    for key in ("completed", "failed", "request_throughput", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms",
                "e2el_ms", "slo_attainment", "goodput", "simulated_time_s", "wall_time_s", "speedup",
                "timelines", "instances", "requests", "kv_blocks_per_instance", "command"):
        assert key in r, key
    assert r["num_requests"] == 120 and r["completed"] + r["failed"] == 120
    assert r["simulated_time_s"] > 50 and r["wall_time_s"] > 0
    assert len(r["timelines"]) == 2 and r["timelines"][0]["t"]
    for png in r["plots"]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(p.endswith("_instances.png") for p in r["plots"])
    text = capsys.readouterr().out
    assert "faster than real time" in text


def test_capacity_search(tmp_path):
    out = tmp_path / "c.json"
    rc = _run(["--model", "llama-2-7b", "--hardware", "a100-80g", "--workload", "alpaca", "--num-requests", "200",
               "--slo", "ttft=500,tpot=40", "--capacity-search", "--search-low", "1", "--search-high", "64",
               "--max-probes", "6", "--output", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    r = json.loads(out.read_text())
    cs = r["capacity_search"]
    assert len(cs["probes"]) >= 3
    passed = [p["rate"] for p in cs["probes"] if p["passed"]]
    failed = [p["rate"] for p in cs["probes"] if not p["passed"]]
    assert passed and failed and max(passed) < min(failed)
    assert cs["capacity_rps"] == max(passed)


def test_capacity_search_over_a_trace_window_serves_the_rate_it_reports(tmp_path, capsys):
    """A trace that thins out (dense first, sparse later), searched within a 60 s window: the run at
    the capacity found serves exactly that mean rate in the window, and the summary says what the
    rate is (the window's requests, rescaled within it), not the whole trace's rescaled mean."""
    trace = tmp_path / "t.csv"
    times = [0.05 * i for i in range(300)] + [15 + 4.0 * i for i in range(300)]
    trace.write_text("time,input_len,output_len\n" + "".join(f"{t:.3f},{64 + i % 50},{16 + i % 7}\n"
                                                            for i, t in enumerate(times)))
    out = tmp_path / "c.json"
    rc = _run(["--model", "llama-2-7b", "--hardware", "a100-80g", "--trace", str(trace), "--duration", "60",
               "--slo", "ttft=500,tpot=40", "--capacity-search", "--search-low", "0.5", "--search-high", "8",
               "--max-probes", "4", "--output", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    r = json.loads(out.read_text())
    cap = r["capacity_search"]["capacity_rps"]
    assert cap is not None and r["workload"]["mean_rate"] == pytest.approx(cap)
    assert r["workload"]["span_s"] <= 60 and r["num_requests"] == min(600, int(cap * 60) + 1)
    text = capsys.readouterr().out
    assert "within the 60 s window" in text and f"a mean {cap:.3g} req/s" in text


def test_a_swap_space_too_small_for_a_request_is_said_and_its_fallbacks_counted(tmp_path, capsys):
    """Requests of 2,300 tokens (144 KV blocks of llama-3-8b) and 64 blocks of swap space: the
    preemptions of requests past 1,024 tokens recompute instead of swapping, and the run says so (a warning at the start, the
    fallbacks in the summary and the JSON); the default swap space (4 GiB, vLLM's) swaps them."""
    argv = ["--model", "llama-3-8b", "--hardware", "a100-80g", "--kv-cache-memory", "1GiB", "--workload",
            "fixed:2000:300", "--num-requests", "40", "--preemption-mode", "swap", "--no-progress", "--no-plots"]
    assert _run([*argv, "--swap-space", "128MiB", "--output", str(tmp_path / "small.json")]) == 0
    printed = capsys.readouterr()
    r = json.loads((tmp_path / "small.json").read_text())
    pre = r["preemptions"]
    assert pre["swap_fallbacks"] == pre["recompute"] > 0 and pre["total"] == pre["swap"] + pre["recompute"]
    assert "swap-space 128 MiB holds 64 KV blocks" in r["swap_warning"] and r["swap_warning"] in printed.err
    assert f"{pre['swap_fallbacks']} of them wanted to swap but the swap space was full" in printed.out
    assert _run([*argv, "--output", str(tmp_path / "default.json")]) == 0
    printed = capsys.readouterr()
    r = json.loads((tmp_path / "default.json").read_text())
    assert r["preemptions"]["swap"] > 0 and r["preemptions"]["swap_fallbacks"] == 0
    assert "swap_warning" not in r and "warning" not in printed.err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["--model", "llama-3-70b", "--hardware", "a100-80g"], "do not fit"),
    (["--batching", "magic"], "unknown policy 'magic'"),
    (["--trace", "/nonexistent.csv"], "trace file not found"),
    (["--cost-model", "profiled"], "needs a profile file"),
])
def test_bad_arguments_give_one_line(tmp_path, capsys, argv, needle):
    rc = _run([*argv, "--workload", "alpaca", "--num-requests", "5", "--output", str(tmp_path / "x.json"),
               "--no-progress"] if "--trace" not in argv else [*argv, "--output", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and err.count("\n") == 1, err


def test_cli_entry_point_runs_sim(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidal.cli", "sim", "--model", "smollm2-135m", "--hardware", "cpu",
                           "--workload", "fixed:64:8", "--num-requests", "4", "--output", str(tmp_path / "s.json"),
                           "--no-plots", "--no-progress"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "4 completed" in proc.stdout


def _parse(*argv: str):
    from tidal.cli import build_parser

    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("wl", [
    ["--workload", "uniform:16-64:4-8", "--num-requests", "20", "--rate", "4", "--burstiness", "0.5",
     "--seed", "3", "--max-input-len", "48", "--max-output-len", "6"],
    ["--workload", "sharegpt-lengths", "--num-requests", "12", "--rate", "2", "--seed", "1", "--traces-dir",
     "TRACES"],
    ["--trace", "TRACES/azure2023_conv.csv", "--time-scale", "3", "--num-requests", "15", "--max-input-len", "900"],
])
def test_bench_serve_and_sim_take_the_same_workload_flags(wl):
    """The same workload flags give the same requests in `tidal sim` and `tidal bench serve`."""
    from tidal import workload as W
    from tidal.bench import serve as bench_serve
    from tidal.common.flags import WORKLOAD_FLAGS, workload_options

    traces = W.default_traces_dir()
    if not os.path.isdir(traces):
        pytest.skip("the shared traces are not here")
    wl = [a.replace("TRACES", traces) for a in wl]
    sim_args = _parse("sim", *wl)
    serve_args = _parse("bench", "serve", "--base-url", "http://127.0.0.1:9", *wl)
    for f in WORKLOAD_FLAGS:  # every workload flag parses to the same value in both commands
        assert getattr(sim_args, f.dest) == getattr(serve_args, f.dest), f.names
    assert workload_options(sim_args) == workload_options(serve_args)
    got_sim = sim_run.workload(sim_args, sim_args.rate)
    got_serve = W.make_requests(bench_serve._workload_options(serve_args, serve_args.rate, serve_args.num_requests))
    assert got_sim == got_serve and len(got_sim) == int(wl[wl.index("--num-requests") + 1])


def test_sim_records_the_dtype_it_simulates(tmp_path):
    """`--dtype auto` is bfloat16 on the simulated devices, the profile's dtype with --profile; float32
    halves the KV blocks of a memory budget."""
    base = ["sim", "--model", "smollm2-135m", "--hardware", "cpu", "--kv-cache-memory", "64MiB"]
    spec = sim_run.cluster_spec(_parse(*base))
    assert sim_run.sim_dtype(_parse(*base)) == "bfloat16" and spec.dtype_bytes == 2
    f32 = sim_run.cluster_spec(_parse(*base, "--dtype", "float32"))
    from tidal.sim.build import resolve

    assert f32.dtype_bytes == 4 and resolve(f32)[2] * 2 == resolve(spec)[2]
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"format": "tidal-profile/1", "dtype": "float32", "block_size": 16, "threads": 1,
                                "samples": [], "overhead": {"per_step_s": 0.0, "per_seq_s": 0.0}}))
    assert sim_run.sim_dtype(_parse(*base, "--profile", str(prof))) == "float32"
    assert sim_run.sim_dtype(_parse(*base, "--profile", str(prof), "--dtype", "bfloat16")) == "bfloat16"


def test_step_jitter_flag_gives_the_steps_tails(tmp_path):
    rows = {}
    for j in ("off", "fitted"):
        out = tmp_path / f"{j}.json"
        assert _run(["--model", "qwen-2.5-14b", "--hardware", "a100-80g", "--instances", "2", "--workload",
                     "fixed:219:64", "--num-requests", "30", "--rate", "2", "--output",
                     str(out), "--no-progress", "--no-plots", "--step-jitter", j]) == 0
        rows[j] = json.loads(out.read_text())
    assert rows["fitted"]["itl_ms"]["p99"] > rows["off"]["itl_ms"]["p99"]
    with pytest.raises(SystemExit) as e:  # argparse's own one-line error
        _run(["--step-jitter", "wild", "--output", str(tmp_path / "x.json")])
    assert e.value.code == 2
