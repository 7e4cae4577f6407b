"""``tidal bench kv-transfer`` end to end through the CLI, tiny."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from tidal.cli import main


def _shm_segments() -> set[str]:
    """The segments this process's transports made (tidal-kv-<pid>-*: other tests' are not ours)."""
    return set(glob.glob(f"/dev/shm/tidal-kv-{os.getpid()}-*"))


def test_kv_transfer_bench_shm_tiny(tmp_path, capsys):
    before = _shm_segments()
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv-transfer", "--transports", "shm", "--model-shape", "llama-3-8b", "--dtype", "float32",
               "--tokens", "4", "--layers-per-chunk", "2", "--repeats", "1", "--output", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.startswith("command: tidal bench kv-transfer --transports shm --model-shape llama-3-8b")
    assert "machine: " in text and "MB/s" in text and "\nshm " in text
    r = json.loads(out.read_text())
    assert r["benchmark"] == "kv-transfer" and r["transports"] == ["shm"] and r["skipped"] == {}
    assert r["command"].startswith("tidal bench kv-transfer") and r["machine"]["cpu_model"]
    assert r["model_shape"] == "llama-3-8b" and r["dtype"] == "float32" and r["layers_per_chunk"] == 2
    assert "process" in r["receivers"]["shm"]
    (row,) = r["rows"]
    assert row["transport"] == "shm" and row["tokens"] == 4 and row["layers"] == 2
    assert row["chunk_bytes"] == 2 * 2 * 4 * 8 * 128 * 4  # K+V x layers x tokens x kv_heads x head_dim x fp32
    assert all(len(v) == 1 for v in row["samples"].values())
    put, get = row["samples"]["put_s"][0], row["samples"]["get_s"][0]
    assert row["latency_ms"] == pytest.approx(1e3 * (put + get))
    assert row["mb_s"] == pytest.approx(row["chunk_bytes"] / 1e6 / (put + get))
    assert row["round_trip_ms"] >= row["latency_ms"] > 0
    assert r["plots"] == [str(tmp_path / "kv.png")] and (tmp_path / "kv.png").stat().st_size > 0
    assert _shm_segments() <= before


def test_kv_transfer_bench_skips_ray_when_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv-transfer", "--transports", "ray", "--tokens", "4", "--repeats", "1",
               "--output", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    assert "ray: skipped: Ray is not installed" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["rows"] == [] and r["transports"] == [] and "not installed" in r["skipped"]["ray"]


@pytest.mark.parametrize("argv,msg", [
    (["--transports", "shm,pigeon"], "unknown transport 'pigeon'"),
    (["--model-shape", "gpt-9"], "unknown model 'gpt-9'"),
    (["--tokens", "0"], "--tokens must be positive"),
    (["--tokens", "a,b"], "invalid literal"),
    (["--layers-per-chunk", "31"], "--layers-per-chunk must be in [1, 30]"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_kv_transfer_bench_bad_arguments(tmp_path, capsys, argv, msg):
    assert main(["bench", "kv-transfer", *argv, "--output", str(tmp_path / "x.json"), "--no-progress"]) == 2
    assert msg in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_kv_transfer_bench_ray_tiny(tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv-transfer", "--transports", "ray", "--tokens", "4,64", "--repeats", "1",
               "--output", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [(row["transport"], row["tokens"]) for row in r["rows"]] == [("ray", 4), ("ray", 64)]
    assert "actor" in r["receivers"]["ray"] and all(row["mb_s"] > 0 for row in r["rows"])
    assert not ray.is_initialized()  # the benchmark shut down the Ray it started
