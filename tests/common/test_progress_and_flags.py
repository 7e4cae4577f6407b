"""The shared plumbing: progress lines and bars, and the flag groups' own rules."""

from __future__ import annotations

import argparse
import io

import pytest

from tidal.common import flags as F
from tidal.common.progress import progress_bar, progress_lines
from tidal.config import ConfigError


def test_progress_lines_count_throttle_and_estimate(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("tidal.common.progress.time.perf_counter", lambda: clock[0])
    out = io.StringIO()
    p = progress_lines(4, file=out)
    p.line("loading", count=False)
    clock[0] += 2
    p.line("first run")
    assert out.getvalue().splitlines() == ["[   ...]     0.0s  loading", "[  1/4]     2.0s  first run"]
    out = io.StringIO()
    p = progress_lines(10, every_s=5.0, file=out)
    for done in range(1, 11):
        clock[0] += 1
        p.report(done, f"step {done}")
    lines = out.getvalue().splitlines()
    # every 5 s (at 5 and 10 s), and the last one always; 5 of 10 done in 5 s: ~5 s left
    assert lines == ["[  5/10]     5.0s  step 5, ~5s left", "[ 10/10]    10.0s  step 10"]
    quiet = io.StringIO()
    q = progress_lines(2, enabled=False, file=quiet)
    q.line("x")
    q.report(2, "y")
    assert quiet.getvalue() == "" and q.done == 2


def test_startup_phases_say_when_they_begin_and_end(monkeypatch, capsys):
    from tidal.common import progress

    clock = [100.0]
    monkeypatch.setattr("tidal.common.progress.time.perf_counter", lambda: clock[0])
    with progress.startup_phase("building the kernels", "kernels built"):
        clock[0] += 95.24
    monkeypatch.setattr(progress, "_startup_label", "engine")
    progress.set_startup_label("worker 2 engine")  # what a cluster's worker sets
    progress.startup_line("waiting")
    with pytest.raises(RuntimeError), progress.startup_phase("loading", "loaded"):
        raise RuntimeError("no end line: the error says why")
    assert capsys.readouterr().err.splitlines() == [
        "engine: building the kernels ...", "engine: kernels built in 95.2 s", "worker 2 engine: waiting",
        "worker 2 engine: loading ..."]


def test_progress_bar_disabled_does_nothing_and_enabled_counts(capsys):
    with progress_bar(3, "off", enabled=False) as bar:
        bar.update(1)
        bar.advance_to(2.5)
    assert capsys.readouterr().err == ""
    with progress_bar(10, "on", "sim-s", mininterval=0) as bar:
        bar.advance_to(4)
        bar.advance_to(3)  # never backwards
        bar.advance_to(25)  # never past the total
        assert bar.pos == 10
    assert "on" in capsys.readouterr().err


def test_generate_use_tqdm_draws_the_shared_bar(make_engine, capsys):
    from tidal import LLM, SamplingParams

    llm = LLM.from_engine(make_engine())
    capsys.readouterr()  # the engine's start-up lines
    sp = SamplingParams(temperature=0, max_tokens=2)
    quiet = llm.generate(["a", "b"], sp)
    assert capsys.readouterr().err == ""
    shown = llm.generate(["a", "b"], sp, use_tqdm=True)
    err = capsys.readouterr().err
    assert "generate" in err and "2/2" in err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]


def test_group_overrides_must_name_real_flags():
    p = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="max_num_seq"):
        F.add_scheduler_flags(p, defaults={"max_num_seq": 3})  # a typo in a command's definition
    p = argparse.ArgumentParser()
    F.add_workload_flags(p, only=("rate", "seed"), defaults={"rate": 2.0})
    assert vars(p.parse_args([])) == {"rate": 2.0, "seed": 0}
    with pytest.raises(SystemExit) as e:  # workload numbers must be positive: argparse's own error, exit 2
        p.parse_args(["--rate", "0"])
    assert e.value.code == 2


def test_capacity_flags_are_checked_once_for_every_command():
    p = argparse.ArgumentParser()
    F.add_workload_flags(p, only=("rate", "time_scale"))
    F.add_slo_flags(p)
    with pytest.raises(ConfigError, match="drop --rate"):
        F.check_capacity_flags(p.parse_args(["--capacity-search", "--rate", "2"]))
    with pytest.raises(ConfigError, match="--search-low must be below"):
        F.check_capacity_flags(p.parse_args(["--capacity-search", "--search-low", "8", "--search-high", "4"]))
    F.check_capacity_flags(p.parse_args(["--rate", "2"]))  # no search: nothing to check
    search = F.capacity_search(p.parse_args(["--capacity-search", "--search-low", "1", "--search-high", "9"]))
    assert (search.low, search.high, search.target, search.max_probes) == (1.0, 9.0, 0.9, 8)


def test_serve_profile_gives_the_profiled_eq1_to_the_scheduler_config(tmp_path):
    """``tidal serve --profile FILE``: KunServe Eq. 1's alpha, beta, gamma from ``tidal profile``
    reach every engine's ``SchedulerConfig.microbatch_cost``; a bad file is one ConfigError line."""
    import json

    from tidal.config import EngineConfig

    p = argparse.ArgumentParser()
    F.add_engine_flags(p)
    F.add_scheduler_flags(p)
    F.add_pipeline_flags(p)
    assert "microbatch_cost" not in F.engine_kwargs(p.parse_args([]))
    good = tmp_path / "profile.json"
    good.write_text(json.dumps({"format": "tidal-profile/1", "eq1": {"alpha": 1e-9, "beta": 2e-6, "gamma": 3e-4}}))
    kw = F.engine_kwargs(p.parse_args(["--profile", str(good)]))
    assert kw["microbatch_cost"] == (1e-9, 2e-6, 3e-4)
    assert EngineConfig.from_kwargs(**kw).scheduler.microbatch_cost == (1e-9, 2e-6, 3e-4)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "tidal-profile/1", "samples": []}))
    for path, msg in ((old, "has no Eq. 1 coefficients"), (tmp_path / "none.json", "cannot read the profile")):
        with pytest.raises(ConfigError, match=msg) as e:
            F.engine_kwargs(p.parse_args(["--profile", str(path)]))
        assert "\n" not in str(e.value) and str(e.value).startswith("--profile: ")
    with pytest.raises(ConfigError, match="microbatch_cost must be"):
        EngineConfig.from_kwargs(microbatch_cost=(0.0, 0.0, 1.0))


def test_cpu_threads_share_from_the_environment(monkeypatch):
    from tidal.common.machine import machine_info
    from tidal.config import affinity_cores, default_cpu_threads

    monkeypatch.setenv("TIDAL_CPU_THREADS", "3")
    assert default_cpu_threads() == 3
    assert machine_info()["cores"] == affinity_cores()  # the machine is still reported whole
    monkeypatch.delenv("TIDAL_CPU_THREADS")
    assert default_cpu_threads() == affinity_cores()
    for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "TIDAL_NATIVE_SIMD"):
        monkeypatch.delenv(var, raising=False)
    assert "isa_limits" not in machine_info()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # a run limited to AVX2 says so
    assert machine_info()["isa_limits"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    for bad in ("0", "two"):
        monkeypatch.setenv("TIDAL_CPU_THREADS", bad)
        with pytest.raises(ConfigError, match="TIDAL_CPU_THREADS must be a positive integer"):
            default_cpu_threads()
