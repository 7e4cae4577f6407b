"""``--dtype auto`` on CPU: float32 without native bf16; with it, the faster of the two by a timing
kept once per machine, bf16 when float32 weights would not fit."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.engine import dtype_pick
from tidal.engine.sizing import dtype_name, resolve_dtype


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty disk cache and no timing kept in this process."""
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dtype_pick, "_picked", {})
    return tmp_path


def test_no_native_bf16_is_float32_without_timing(fresh, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(dtype_pick, "_bf16_over_f32", lambda *a: pytest.fail("timed without native bf16"))
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert dtype_name("auto", "cpu") == "float32"


@pytest.mark.parametrize(("ratio", "picked"), [(2.0, torch.bfloat16), (1.05, torch.float32), (0.5, torch.float32)])
def test_native_bf16_is_picked_only_where_it_is_faster(fresh, monkeypatch, ratio, picked):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    timed = []
    monkeypatch.setattr(dtype_pick, "_bf16_over_f32", lambda m, k, n, r: timed.append((m, k, n)) or ratio)
    assert resolve_dtype("auto", torch.device("cpu")) is picked
    assert timed == list(dtype_pick.SHAPES)
    assert dtype_pick.bf16_speedup_percent() == round(100 * ratio)  # kept: not timed again
    assert len(timed) == len(dtype_pick.SHAPES)
    # an explicit dtype is never second-guessed
    assert resolve_dtype("float32", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16


def test_the_timing_is_kept_on_disk_for_every_process(fresh, monkeypatch, capsys):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtype_pick, "_bf16_over_f32", lambda *a: 0.6)
    assert dtype_pick.cpu_auto_dtype() is torch.float32
    err = capsys.readouterr().err.splitlines()  # the timing is a start-up phase: a line as it begins and ends
    assert len(err) == 2 and err[0] == ("engine: timing bfloat16 against float32 matmuls for --dtype auto (once per "
                                        "machine) ...") and err[1].startswith("engine: timed in "), err
    stored = json.loads((fresh / "crossovers.json").read_text())
    assert [v for k, v in stored.items() if k.startswith("bf16_over_f32")] == [60]
    # another process: nothing in memory, the file answers (timing now would fail the test)
    monkeypatch.setattr(dtype_pick, "_picked", {})
    monkeypatch.setattr(dtype_pick, "_bf16_over_f32", lambda *a: pytest.fail("timed again"))
    assert dtype_pick.cpu_auto_dtype() is torch.float32
    assert capsys.readouterr().err == ""


def test_float32_weights_that_would_not_fit_keep_bf16(fresh, monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(dtype_pick, "_bf16_over_f32", lambda *a: 0.5)  # float32 would be faster
    half = dtype_pick._total_memory() // 2
    assert resolve_dtype("auto", torch.device("cpu"), f32_weight_bytes=half + 1) is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), f32_weight_bytes=half - 1) is torch.float32


def test_the_real_timing_gives_a_ratio(fresh):
    """Both matmuls run on this CPU and give a positive, finite ratio (whichever is faster here)."""
    r = dtype_pick._bf16_over_f32(8, 64, 128, repeats=3)
    assert 0 < r < float("inf")
