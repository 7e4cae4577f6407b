"""benchmarks/sampler_speed.py writes a figures record the performance page reads, one row per vocabulary,
batch, logits shape and sampling setup."""

from __future__ import annotations

import importlib.util
import json
import os

from tidal.bench.report import kind_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_record(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("sampler_speed", os.path.join(ROOT, "benchmarks", "sampler_speed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "s.json"
    assert mod.main(["--batches", "1,3", "--vocabs", "300", "--repeats", "1", "--engine-batch", "2",
                     "--output", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert kind_of(rec) == "figures"
    per = len(mod.CONFIGS) + (len(mod.CONFIGS) - 1) * (len(mod.SHAPES) - 1)  # greedy on one shape only
    assert len(rec["figures"]) == 2 * per + len(mod.ENGINE_CONFIGS)
    assert all(v.endswith((" ms", " tok/s")) and float(v.split()[0].replace(",", "")) > 0 for _, v in rec["figures"])
    names = [n for n, _ in rec["figures"]]
    assert "vocabulary 300, batch 3, peaked logits, top-p 0.9" in names
    assert "default model, 2 requests x 64 -> 64 tokens, top-p 0.9" in names
