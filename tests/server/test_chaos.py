"""``tidal bench soak --chaos``, short, in every mode: a random worker of a two-instance server is
SIGKILLed every 2 s under streaming load (colocated, P/D, split, ``--kv-pressure drop`` and
``migrate``). No request may be lost or answered with anything but its completion or a 503 with
``Retry-After`` and an OpenAI error body; every killed worker comes back and is gone; no KV block
is left in use; /health says 200 or 503 throughout; the server exits 0 with no traceback.

The servers run a random-weight 4-layer Llama (the default model's vocabulary and tokenizer): the
fault handling does not depend on the weights, and a worker restarts in a second instead of ten.
They start together, so their start-ups overlap."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.server.conftest import ServerProcess
from tidal.cli import main

COMMON = ("--instances", "2", "--threads-per-instance", "1", "--max-num-seqs", "8")
MODES = {  # a small KV pool where the mode acts on KV pressure, so that its moves and groups meet the kills
    "colocate": ("--kv-cache-memory", "8MiB"),
    "disaggregate": ("--mode", "disaggregate", "--prefill-instances", "1", "--kv-cache-memory", "8MiB"),
    "split": ("--mode", "split", "--kv-cache-memory", "8MiB"),
    "drop": ("--kv-pressure", "drop", "--kv-cache-memory", "768KiB"),
    "migrate": ("--kv-pressure", "migrate", "--kv-cache-memory", "768KiB"),
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tiny_llama, smol_tokenizer):
    """The tiny Llama with the default model's tokenizer files beside it (a server loads both)."""
    path = tmp_path_factory.mktemp("tiny-served")
    shutil.copytree(tiny_llama.path, path, dirs_exist_ok=True)
    smol_tokenizer.hf.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def servers(tiny_model):
    procs = {m: ServerProcess("--model", tiny_model, *COMMON, *flags) for m, flags in MODES.items()}
    yield procs
    for p in procs.values():
        p.terminate()
    for m, p in procs.items():
        code = p.stop()
        assert code == 0, f"the {m} server exited with {code}:\n{p.final_output[-3000:]}"
        assert "Traceback" not in p.final_output, f"{m}:\n{p.final_output[-3000:]}"


@pytest.mark.parametrize("mode", list(MODES))
def test_short_chaos_soak_loses_nothing(servers, mode, tmp_path, capsys):
    server = servers[mode].wait_ready()
    out = tmp_path / "chaos.json"
    code = main(["bench", "soak", "--base-url", server.url, "--chaos", "--chaos-interval", "2", "--duration", "6",
                 "--capacity", "6", "--multiple", "1", "--max-tokens", "48", "--health-interval", "0.25",
                 "--progress-interval", "3", "--disconnect-fraction", "0.1", "--malformed-fraction", "0.05",
                 "--idle-timeout", "90", "--seed", str(list(MODES).index(mode)), "--output", str(out)])
    printed = capsys.readouterr()
    print(printed.err, printed.out)
    r = json.loads(out.read_text())
    ch = r["chaos"]
    assert ch["kills"] >= 2, ch  # it did kill, under load
    assert r["lost_streams"] == 0 and r["other_errors"] == 0 and r["failed"] == 0, r["errors"]
    assert r["refused"] == r["refused_503"] + r["refused_429"]  # every refusal carried Retry-After and an error body
    assert r["completed"] > 0 and r["idle"] and r["leaked_kv_blocks"] == 0
    assert ch["not_back"] == 0 and ch["processes_left"] == 0
    assert r["health_ok"] and r["processes_end"] == r["processes_start"]
    assert r["sent"] == r["completed"] + r["refused"] + r["failed"] + r["disconnected"] + r["malformed_rejected"]
    assert code == 0 and r["clean"] and "verdict: CLEAN" in printed.out and "chaos: SIGKILL instance" in printed.err
