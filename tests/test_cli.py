"""The command line: one clear line for bad input, real text for good input."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest


def tidal(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _print_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def tidal_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``tidal.cli.main(args)`` in this process (no interpreter start-up), with what a fresh one shows:
    the CLI's own logging setup and every warning printed to stderr (pytest would capture both)."""
    from tidal.cli import main

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []  # so that main()'s logging.basicConfig installs its stderr handler
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters, printing to stderr
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _print_warning
            rc = main(list(args))
    finally:
        root.handlers, root.level = handlers, level
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


@pytest.mark.parametrize("args, needle", [
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
    (["generate", "hi", "--kv-cache-memory", "lots"], "kv_cache_memory"),
    (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs"),
    (["generate", "hi", "--batching", "nope"], "unknown policy 'nope'"),
])
def test_bad_arguments_give_one_line(args, needle, tmp_path, capsys, reuse_smol_tokenizer):
    r = tidal_in_process(capsys, *args)  # the real process's exit code: test_garbage_model_file
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_garbage_model_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("this is not a gguf file")
    r = tidal("generate", "hi", "--model", str(bad))
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr


def test_generate_prints_greedy_completion(make_engine):
    from tidal import LLM, SamplingParams

    r = tidal("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    ref = LLM.from_engine(make_engine()).generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    assert r.stdout.rstrip("\n") == ref[0].outputs[0].text.rstrip("\n")
